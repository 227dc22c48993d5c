"""The sequenced event buffer: every runtime event gets a seq and stays until the site acknowledges it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

LIMIT = 100_000


class Outbox:
    """Events numbered from 1, kept in order until acknowledged; thread-safe.

    Bounded: when `limit` events are waiting (the site is unreachable for long), new `step` events are
    dropped and counted in `dropped`; an event of any other kind (iteration, device-*, job-stopped) evicts
    the oldest waiting step instead, and is only kept over the limit when no step is left to evict.
    """

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self.dropped = 0
        self._events: deque[dict] = deque()
        self._seq = 0
        self._lock = threading.Lock()
        self._watcher: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call `callback()` after each event is added (in the adding thread, outside the lock); None: no more."""
        self._watcher = callback

    @property
    def last_seq(self) -> int:
        """The seq of the last event added (dropped steps take none)."""
        return self._seq

    def add(self, job, event: dict) -> int | None:
        """Buffer an event of `job`; its seq, or None when it was a step dropped because the buffer is full."""
        with self._lock:
            if len(self._events) >= self.limit:
                if event.get("type") == "step":
                    self.dropped += 1
                    return None
                self._evict_step()
            self._seq += 1
            self._events.append({"seq": self._seq, "job": job, "event": event})
            seq = self._seq
        watcher = self._watcher
        if watcher is not None:
            watcher()
        return seq

    def _evict_step(self) -> None:
        for i, entry in enumerate(self._events):
            if entry["event"].get("type") == "step":
                del self._events[i]
                self.dropped += 1
                return

    def pending(self, after: int = 0) -> list[dict]:
        """Unacknowledged events with a seq above `after`, in order (`{"seq", "job", "event"}` each)."""
        with self._lock:
            newer = []
            for entry in reversed(self._events):  # newest first: a sender asks for the few it has not sent
                if entry["seq"] <= after:
                    break
                newer.append(entry)
            return newer[::-1]

    def ack(self, seq: int) -> None:
        """The site stored every event up to `seq`: forget them."""
        with self._lock:
            while self._events and self._events[0]["seq"] <= seq:
                self._events.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
