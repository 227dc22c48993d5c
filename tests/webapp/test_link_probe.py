"""A board's link, measured by its agent against the site and planned with: the probe endpoint, the hello field,
and the engine device a job plans on."""

import pytest
from django.core.cache import cache
from django.test import Client

from webapp.devices.api import LINK_SLOT_KEY, LINK_SLOT_S
from webapp.devices.models import Device
from webapp.devices.protocol import CHECKS, ProtocolError


@pytest.fixture(autouse=True)
def no_one_measuring():
    cache.delete(LINK_SLOT_KEY)  # the cache is Redis's where REDIS_URL is set: another test's turn may linger


@pytest.mark.django_db
def test_the_link_probe_counts_what_arrived_for_a_device_in_its_turn_only():
    device = Device.objects.create(name="nano-7", kind="jetson-nano")
    _, credential = Device.enroll(device.issue_enrollment())
    client, url, slot = Client(), "/api/agent/link/", "/api/agent/link/slot/"
    assert client.post(url, b"x" * 10, content_type="application/octet-stream").status_code == 401
    assert client.post(slot).status_code == 401
    auth = {"HTTP_AUTHORIZATION": f"Bearer {credential}"}
    early = client.post(url, bytes(10), content_type="application/octet-stream", **auth)
    assert early.status_code == 409 and "in its turn" in early.json()["error"]
    assert client.post(slot, **auth).json() == {"seconds": LINK_SLOT_S}
    ok = client.post(url, bytes(300_000), content_type="application/octet-stream", **auth)
    assert ok.status_code == 200 and ok.json() == {"received": 300_000}
    big = client.post(url, bytes(9 * 1024 * 1024), content_type="application/octet-stream", **auth)
    assert big.status_code == 413 and "at most" in big.json()["error"]
    assert client.get(url, **auth).status_code == 405
    assert client.delete(slot, **auth).json() == {"released": True}
    assert client.post(url, bytes(10), content_type="application/octet-stream", **auth).status_code == 409


@pytest.mark.django_db
def test_boards_measure_their_links_one_at_a_time():
    turns = []
    for name in ("nano-1", "nano-2"):
        device = Device.objects.create(name=name, kind="jetson-nano")
        turns.append({"HTTP_AUTHORIZATION": f"Bearer {Device.enroll(device.issue_enrollment())[1]}"})
    client, slot = Client(), "/api/agent/link/slot/"
    assert client.post(slot, **turns[0]).status_code == 200
    busy = client.post(slot, **turns[1])
    assert busy.status_code == 429 and busy["Retry-After"] and "another board" in busy.json()["error"]
    assert client.delete(slot, **turns[1]).status_code == 200  # not its turn: nothing given back
    assert client.post(slot, **turns[1]).status_code == 429
    assert client.post(slot, **turns[0]).status_code == 200  # asking again keeps it
    client.delete(slot, **turns[0])
    assert client.post(slot, **turns[1]).status_code == 200


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
    busy = Device.objects.create(name="nx-9", kind="jetson-xavier-nx", measured={"link_mbps": 211.2})
    assert busy.to_engine(1000).link_mbps is None  # a gigabit veth read by a loaded site (CI, 2026-11-28): noise
    wifi = Device.objects.create(name="nano-9", kind="jetson-nano", measured={"link_mbps": 120.0})
    assert wifi.to_engine(1000).link_mbps == 120.0  # under an eighth of the job's bandwidth
    assert unmeasured.to_engine(1000).link_mbps is None
    assert slow.to_engine().link_mbps is None
    assert slow.to_engine(1000).kind == "jetson-nano"  # still a Nano: only its link is its own
