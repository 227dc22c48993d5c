"""The configured channel layer carries a message (in memory here; on Redis when REDIS_URL is set, as in CI)."""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def test_group_message_roundtrip():
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("jobs-test", channel)
    async_to_sync(layer.group_send)("jobs-test", {"type": "iteration", "iteration": 3})
    assert async_to_sync(layer.receive)(channel) == {"type": "iteration", "iteration": 3}
    async_to_sync(layer.group_discard)("jobs-test", channel)
