"""The event buffer: seq numbers, acks, resend order, the bound, and adds from several threads."""

import threading

from workers.outbox import Outbox


def step(i: int) -> dict:
    return {"type": "step", "iteration": i}


def test_seq_counts_up_from_one_and_pending_keeps_order():
    box = Outbox()
    assert [box.add(7, step(i)) for i in range(5)] == [1, 2, 3, 4, 5]
    assert [e["seq"] for e in box.pending()] == [1, 2, 3, 4, 5]
    assert box.pending()[2] == {"seq": 3, "job": 7, "event": step(2)}
    assert [e["seq"] for e in box.pending(after=3)] == [4, 5]


def test_ack_drops_everything_up_to_seq_and_the_rest_is_resent_with_the_same_seqs():
    box = Outbox()
    for i in range(6):
        box.add(1, step(i))
    box.ack(4)
    assert [(e["seq"], e["event"]["iteration"]) for e in box.pending()] == [(5, 4), (6, 5)]
    box.ack(2)  # an old ack changes nothing
    assert len(box) == 2
    assert box.add(1, step(6)) == 7  # numbering goes on after acks
    box.ack(7)
    assert box.pending() == [] and len(box) == 0


def test_a_full_buffer_drops_steps_first_and_never_iterations_or_device_events():
    box = Outbox(limit=4)
    box.add(1, {"type": "device-start"})
    box.add(1, step(0))
    box.add(1, step(0))
    box.add(1, {"type": "iteration", "iteration": 0})
    assert box.add(1, step(1)) is None  # full: a new step is dropped and counted
    assert box.dropped == 1
    assert box.add(1, {"type": "iteration", "iteration": 1}) == 5  # evicts the oldest step instead
    assert box.add(1, {"type": "device-done"}) == 6
    assert box.dropped == 3
    kinds = [e["event"]["type"] for e in box.pending()]
    assert kinds == ["device-start", "iteration", "iteration", "device-done"]
    box.add(1, {"type": "job-stopped"})  # nothing left to evict: kept over the limit rather than lost
    assert len(box) == 5


def test_adds_from_many_threads_get_unique_consecutive_seqs():
    box = Outbox()
    seqs: list[int] = []
    lock = threading.Lock()

    def producer() -> None:
        mine = [box.add(1, step(0)) for _ in range(2000)]
        with lock:
            seqs.extend(mine)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs) == list(range(1, 8001))
    assert [e["seq"] for e in box.pending()] == list(range(1, 8001))
