"""How long a silent device is waited for before it is lost: what a LAN's links and TCP can deliver."""

from __future__ import annotations

HEARTBEAT_S = 0.2  # how often a device's heartbeat thread bumps its counter and reads the coordinator's flags
POLL_S = 0.2  # how often the coordinator reads the store: heartbeat counters, the devices' reports after a stop
TCP_RTO_MIN_S = 0.2  # Linux's least retransmission timeout: a lost segment is sent again after it, then 2x, 4x, ...
FLAP_S = 2.0  # a link outage (a flapping cable, a switch port resetting) this short is ridden out by default
LINK_QUEUE_S = 0.4  # the longest a heartbeat waits behind other traffic in a board's link queue (tc tbf's 400 ms)


def tcp_resume_s(outage_s: float) -> float:
    """When an established TCP connection's first retransmission after a link outage of `outage_s` gets through:
    the retries back off from TCP_RTO_MIN_S, doubling, so a connection hears nothing until the first one past it."""
    t, rto = 0.0, TCP_RTO_MIN_S
    while t < outage_s:
        t, rto = t + rto, min(2 * rto, 120.0)
    return t


def detection_window(flap_s: float = FLAP_S, queue_s: float = LINK_QUEUE_S) -> float:
    """Seconds without a heartbeat before a device is lost, from what a LAN can deliver: a heartbeat's period
    and the coordinator's read of it, a heartbeat stuck behind a full link queue, and a link outage of `flap_s`
    ridden out by TCP's retransmissions (a board back within the window keeps its place)."""
    return HEARTBEAT_S + POLL_S + queue_s + tcp_resume_s(flap_s)
