"""The detection window: what a LAN's heartbeats, link queues and TCP retransmissions can deliver."""

import pytest

from engine.runtime.detection import HEARTBEAT_S, LINK_QUEUE_S, POLL_S, detection_window, tcp_resume_s


@pytest.mark.parametrize(
    "outage, resumes",
    [(0.0, 0.0), (0.1, 0.2), (0.2, 0.2), (1.0, 1.4), (1.5, 3.0), (2.0, 3.0), (3.5, 6.2)],
)
def test_tcp_resumes_at_the_first_backed_off_retransmission_past_an_outage(outage, resumes):
    # retries at 0.2, 0.6, 1.4, 3.0, 6.2 s: 200 ms, doubling
    assert tcp_resume_s(outage) == pytest.approx(resumes)


def test_the_default_window_outlasts_a_two_second_flap_and_a_full_link_queue():
    window = detection_window()
    assert window == pytest.approx(HEARTBEAT_S + POLL_S + LINK_QUEUE_S + 3.0)
    # a flap of 1.5 s (the issue's) is ridden out: its heartbeats resume before the window ends
    assert HEARTBEAT_S + POLL_S + tcp_resume_s(1.5) < window
    # and the window grows with the outage a lab wants to ride out
    assert detection_window(flap_s=5.0) > window > detection_window(flap_s=0.5)
