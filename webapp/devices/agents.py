"""Messages from the site to a device's agent, through the Channels group its socket joins (`agent.<device id>`)."""

from __future__ import annotations

from webapp.lib.groups import group_send, try_group_send


def agent_group(device_id: int) -> str:
    return f"agent.{device_id}"


def tell_agent(device_id: int, message: dict) -> None:
    """To the agent of a device, if it is connected (messages to an absent agent are dropped)."""
    group_send(agent_group(device_id), "agent.message", message)


def try_tell_agent(device_id: int, message: dict) -> bool:
    """`tell_agent`, best-effort: False (and a warning in the log) when the channel layer cannot be reached."""
    return try_group_send(agent_group(device_id), "agent.message", message)


def disconnect_agent(device_id: int) -> None:
    """Close the socket of a device whose credential was revoked."""
    group_send(agent_group(device_id), "agent.revoked", {})
