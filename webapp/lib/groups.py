"""Sending to a Channels group from sync code (views, tasks, database_sync_to_async helpers)."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis import RedisError

log = logging.getLogger(__name__)

UNREACHABLE = (RedisError, OSError)  # the channel layer's Redis is down, restarting or out of reach
_unreachable = False  # this process has said so, and has not reached it since


def group_send(group: str, handler: str, message: dict) -> None:
    """`message` to every consumer in `group`, handled by their `handler` method; a no-op without a channel layer."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": handler, "message": message})


def try_group_send(group: str, handler: str, message: dict) -> bool:
    """`group_send`, best-effort: False when the channel layer cannot be reached (its Redis down or restarting),
    which the log says in one warning line per outage, not per message. For messages their readers can do without:
    the database holds the state (a job's page reads it back when its socket reconnects)."""
    global _unreachable
    try:
        group_send(group, handler, message)
    except UNREACHABLE as exc:
        if not _unreachable:
            _unreachable = True
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
            log.warning("cannot reach the channel layer (%s: %s): messages to browsers and agents are dropped "
                        "until it is back", type(exc).__name__, why)  # fmt: skip
        return False
    _unreachable = False
    return True
