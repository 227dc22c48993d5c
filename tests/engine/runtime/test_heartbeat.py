"""A device's heartbeat thread: the coordinator's flags it reads belong to the generation the device runs."""

import time
from datetime import timedelta

import torch.distributed as dist

from engine.runtime.control import Heartbeat, gen_key, key
from workers.device import free_port


class MovesOnWhileReading:
    """The heartbeat's own store connection, whose read of generation `g`'s stop lets the device move on to
    generation g + 1 before the value comes back: the race that kept a stale stop into the next generation."""

    def __init__(self, store, hb: Heartbeat, g: int):
        self.store, self.hb, self.g, self.raced = store, hb, g, False

    def add(self, k, n):
        return self.store.add(k, n)

    def check(self, keys):
        return self.store.check(keys)

    def get(self, k):
        value = self.store.get(k)
        if k == gen_key(self.g, "stop") and not self.raced:
            self.raced = True
            self.hb.watch(self.g + 1)  # the main thread starts generation g + 1 meanwhile
        return value


def test_a_stop_read_for_the_generation_that_just_ended_is_not_kept_for_the_next():
    # regression: gen 1's stop (3) was kept into gen 2, whose devices then stopped after their first iteration
    # with no stop asked, and the run went silent (tests/e2e/test_recovery.py, remove then add, now and then)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    server.set(gen_key(1, "stop"), "3")
    hb = Heartbeat("127.0.0.1", port, "nano-0", 10)
    racer = MovesOnWhileReading(hb._store, hb, 1)
    hb._store = racer
    hb.watch(1)
    hb.start()
    try:
        deadline = time.monotonic() + 5
        while not racer.raced and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a few more heartbeats, all of generation 2 (no stop asked)
        assert racer.raced and hb.generation == 2
        assert hb.stop_at is None
        assert int(server.add(key("hb", "nano-0"), 0)) > 2  # it kept beating
        server.set(gen_key(2, "stop"), "7")  # a stop asked of generation 2 is heard
        deadline = time.monotonic() + 5
        while hb.stop_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hb.stop_at == 7
    finally:
        hb.close()
