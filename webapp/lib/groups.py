"""Sending to a Channels group from sync code (views, tasks, database_sync_to_async helpers)."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from webapp.lib.outage import UNREACHABLE, Outage

log = logging.getLogger(__name__)

_layer = Outage(log, "the channel layer", "messages to browsers and agents are dropped until it is back")


def group_send(group: str, handler: str, message: dict) -> None:
    """`message` to every consumer in `group`, handled by their `handler` method; a no-op without a channel layer."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": handler, "message": message})


def try_group_send(group: str, handler: str, message: dict) -> bool:
    """`group_send`, best-effort: False when the channel layer cannot be reached (its Redis down or restarting),
    which the log says in one warning line per outage, not per message. For messages their readers can do without:
    the database holds the state (a job's page reads it back when its socket reconnects)."""
    try:
        group_send(group, handler, message)
    except UNREACHABLE as exc:
        _layer.failed(exc)
        return False
    _layer.reached()
    return True
