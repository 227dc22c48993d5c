"""Saying once per outage, not once per message, that a shared part (Redis) cannot be reached, and that it is back."""

from __future__ import annotations

import contextlib
import logging
from typing import ClassVar

from redis import RedisError

UNREACHABLE = (RedisError, OSError)  # Redis is down, restarting or out of reach


class Outage:
    """One process's view of whether `what` can be reached: `failed(exc)` logs a warning the first time, `reached()`
    an info line when it comes back."""

    every: ClassVar[list[Outage]] = []  # all of this process's

    def __init__(self, log: logging.Logger, what: str, meanwhile: str) -> None:
        self.log, self.what, self.meanwhile = log, what, meanwhile
        self.down = False  # this process has said so, and has not reached it since
        Outage.every.append(self)

    def failed(self, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
            self.log.warning("cannot reach %s (%s: %s): %s", self.what, type(exc).__name__, why, self.meanwhile)

    def reached(self) -> None:
        if self.down:
            self.down = False
            self.log.info("%s can be reached again", self.what)


class SocketOutage:
    """Mixin for a Channels websocket consumer (before the consumer class in its bases): when the channel layer's
    Redis cannot be reached (down, restarting), the socket is closed with CLOSED (its client connects again) after one
    warning per outage, instead of daphne's traceback per socket; a handshake then is accepted and closed, so that
    it cannot read as a refusal (HTTP 403). `stopped()` runs however the consumer ends."""

    CLOSED = 4500  # daphne takes 1000 or 3000-4999 (not 1011); agents and pages connect again on it
    _outage = Outage(logging.getLogger(__name__), "the channel layer's Redis", "sockets are closed, to connect again")
    accepted = False

    async def accept(self, *args, **kwargs):
        self.accepted = True
        await super().accept(*args, **kwargs)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except UNREACHABLE as exc:
            self._outage.failed(exc)
            with contextlib.suppress(Exception):  # (the client may have gone already)
                if not self.accepted:
                    await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": self.CLOSED})
        else:
            self._outage.reached()
        finally:
            self.stopped()

    def stopped(self) -> None:
        """What the consumer leaves behind (a task of its own) is ended here."""
