"""Saying once per outage, not once per message, that a shared part (Redis) cannot be reached, and that it is back."""

from __future__ import annotations

import logging

from redis import RedisError

UNREACHABLE = (RedisError, OSError)  # Redis is down, restarting or out of reach


class Outage:
    """One process's view of whether `what` can be reached: `failed(exc)` logs a warning the first time, `reached()`
    an info line when it comes back."""

    def __init__(self, log: logging.Logger, what: str, meanwhile: str) -> None:
        self.log, self.what, self.meanwhile = log, what, meanwhile
        self.down = False  # this process has said so, and has not reached it since

    def failed(self, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
            self.log.warning("cannot reach %s (%s: %s): %s", self.what, type(exc).__name__, why, self.meanwhile)

    def reached(self) -> None:
        if self.down:
            self.down = False
            self.log.info("%s can be reached again", self.what)
