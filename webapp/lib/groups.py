"""Sending to a Channels group from sync code (views, tasks, database_sync_to_async helpers)."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def group_send(group: str, handler: str, message: dict) -> None:
    """`message` to every consumer in `group`, handled by their `handler` method; a no-op without a channel layer."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": handler, "message": message})
