"""A board's link, measured by its agent against the site and planned with: the probe endpoint, the hello field,
and the engine device a job plans on."""

import pytest
from django.test import Client

from webapp.devices.models import Device
from webapp.devices.protocol import CHECKS, ProtocolError


@pytest.mark.django_db
def test_the_link_probe_counts_what_arrived_for_a_device_only():
    device = Device.objects.create(name="nano-7", kind="jetson-nano")
    _, credential = Device.enroll(device.issue_enrollment())
    client, url = Client(), "/api/agent/link/"
    assert client.post(url, b"x" * 10, content_type="application/octet-stream").status_code == 401
    auth = {"HTTP_AUTHORIZATION": f"Bearer {credential}"}
    ok = client.post(url, bytes(300_000), content_type="application/octet-stream", **auth)
    assert ok.status_code == 200 and ok.json() == {"received": 300_000}
    big = client.post(url, bytes(9 * 1024 * 1024), content_type="application/octet-stream", **auth)
    assert big.status_code == 413 and "at most" in big.json()["error"]
    assert client.get(url, **auth).status_code == 405


HELLO = {"type": "hello", "session": "s1", "kind": "jetson-nano", "emulated": False, "memory_bytes": 4 << 30,
         "gflops": 470.0}  # fmt: skip


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), float("inf"), "fast", True])
def test_a_hello_with_a_nonsense_link_is_refused_with_the_field_named(bad):
    check = CHECKS["hello"]
    check({**HELLO, "link_mbps": 19.5})
    check(HELLO)  # an agent that could not measure sends none
    with pytest.raises(ProtocolError, match="link_mbps"):
        check({**HELLO, "link_mbps": bad})


@pytest.mark.django_db
def test_a_board_measured_on_a_slow_link_is_planned_on_it_a_fast_one_at_the_jobs_bandwidth():
    slow = Device.objects.create(name="nano-8", kind="jetson-nano", measured={"link_mbps": 19.5})
    fast = Device.objects.create(name="nx-8", kind="jetson-xavier-nx", measured={"link_mbps": 870.0})
    unmeasured = Device.objects.create(name="tx2-8", kind="jetson-tx2")
    assert slow.to_engine(1000).link_mbps == 19.5
    assert slow.to_engine(30).link_mbps is None  # the job's own bandwidth is lower already
    assert fast.to_engine(1000).link_mbps is None  # the probe reads a fast link low: not its own
    assert unmeasured.to_engine(1000).link_mbps is None
    assert slow.to_engine().link_mbps is None
    assert slow.to_engine(1000).kind == "jetson-nano"  # still a Nano: only its link is its own
