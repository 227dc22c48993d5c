"""Waiting on gloo work with the coordinator's abort in mind: a waiter thread, and the device's wait helpers."""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from engine.runtime.stage import PeerLost, gloo_message


class Aborted(RuntimeError):
    """The coordinator stopped this generation (a device was lost)."""


class Waiter:
    """A thread that waits for one gloo work at a time, so the device's own thread can give up on it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="waiter", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, box, done = self._jobs.get()
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - handed back to the device's thread
                box["error"] = exc
            done.set()

    def wait(self, work, abort: threading.Event) -> bool:
        """True once `work` completed (raising its error), False when `abort` came first."""
        box: dict = {}
        done = threading.Event()
        self._jobs.put((work, box, done))
        while not done.wait(0.05):
            if abort.is_set():
                return False
        if "error" in box:
            raise box["error"]
        return True


class Waits:
    """The device's (engine.runtime.worker) waits, which an abort ends, and posts, whose failure is a lost peer.
    Needs `self.hb` (the heartbeat; None without a coordinator), `self.waiter` and `self.gen`."""

    def _wait(self, work, what: str) -> None:
        """Wait for `work`; under a coordinator, on a waiter thread, so that an abort ends the wait at once (a
        gloo wait cannot be cancelled, and one with a timeout breaks the connection: the waiter is left behind)."""
        try:
            if self.hb is None or work.is_completed():
                work.wait()
                return
            if self.waiter is None:
                self.waiter = Waiter()
            if not self.waiter.wait(work, self.hb.abort):
                self.waiter = None  # still blocked on the old generation's work: abandoned with it
                raise Aborted(f"{what} abandoned: the coordinator stopped generation {self.gen.number}")
        except RuntimeError as exc:  # gloo: connection closed by a dead peer, or the group timeout
            if isinstance(exc, Aborted):
                raise
            raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None

    def _post(self, op, what: str, *args):
        try:
            return op(*args)
        except RuntimeError as exc:
            raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None

    def _in_thread(self, fn, what: str):
        """Run a blocking set-up call (a process group's rendezvous) so that an abort can leave it behind."""
        out: dict = {}

        def target() -> None:
            try:
                out["value"] = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                out["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if self.hb is not None and self.hb.abort.is_set():
                raise Aborted(f"{what} abandoned: the coordinator stopped generation {self.gen.number}")
        if "error" in out:
            raise PeerLost(f"{what} failed: {gloo_message(out['error'])}")
        return out["value"]

    def _allreduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self._post(group.allreduce, "an all-reduce", [tensor], opts)
