"""Consumers that dispatch without channels' per-message database clean-up hop.

Channels' `AsyncConsumer.dispatch` runs `close_old_connections` through the process's one thread-sensitive sync
thread before every message it hands to a handler. That thread is where every consumer's database work runs too:
with hundreds of agents' messages and the browsers' relayed updates each taking a turn there, the hops alone queue
up behind one another. Consumers whose handlers touch the database only through `database_sync_to_async` (which
closes stale connections itself, in that thread) do not need it.
"""

from __future__ import annotations

from channels.consumer import get_handler_name


class DirectDispatch:
    """Mixin for an AsyncConsumer whose handlers reach the database only through database_sync_to_async."""

    async def dispatch(self, message):
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)
