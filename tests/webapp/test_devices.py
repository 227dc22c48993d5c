"""The Device model and its admin pages."""

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError

from engine.devices import KINDS
from webapp.devices.models import Device


def test_jetson_kind_fills_memory_and_speed(db):
    device = Device.objects.create(name="nano-lab-0", kind="jetson-nano")
    nano = KINDS["jetson-nano"]
    assert (device.memory_gb, device.gflops) == (nano.memory_gb, nano.gflops)
    assert device.status == "offline" and device.last_heartbeat is None
    assert str(device) == "nano-lab-0 (Jetson Nano, offline)"
    doc = device.to_dict()
    assert doc["name"] == "nano-lab-0" and doc["kind"] == "jetson-nano" and doc["status"] == "offline"
    assert doc["memory_gb"] == 4.0 and doc["last_heartbeat"] is None and doc["created_at"]


def test_kind_choices_follow_the_engine():
    assert [key for key, _ in Device.KIND_CHOICES] == [*KINDS, "custom"]


def test_custom_device_needs_memory_and_speed(db):
    device = Device(name="rig", kind="custom")
    with pytest.raises(ValidationError) as exc:
        device.full_clean()
    assert set(exc.value.message_dict) == {"memory_gb", "gflops"}


def test_names_are_unique(db):
    Device.objects.create(name="tx2-0", kind="jetson-tx2")
    with pytest.raises(IntegrityError):
        Device.objects.create(name="tx2-0", kind="jetson-tx2")


def test_to_engine_matches_the_cluster_file_rules(db):
    tx2 = Device.objects.create(name="tx2-a", kind="jetson-tx2").to_engine()
    assert (tx2.kind, tx2.memory_gb, tx2.reserved_gb) == ("jetson-tx2", 8.0, KINDS["jetson-tx2"].reserved_gb)
    bigger = Device.objects.create(name="tx2-b", kind="jetson-tx2", memory_gb=16).to_engine()
    assert bigger.kind == "custom" and bigger.memory_gb == 16


def test_admin_changelist_for_staff_only(client, alice, bob):
    Device.objects.create(name="nx-0", kind="jetson-xavier-nx")
    url = "/admin/devices/device/"
    client.force_login(alice)
    page = client.get(url)
    assert page.status_code == 200
    assert b"nx-0" in page.content
    assert client.get(url, {"status__exact": "offline"}).status_code == 200  # list_filter works

    client.force_login(bob)
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


def test_admin_add_form_fills_kind_defaults(client, alice):
    client.force_login(alice)
    response = client.post(
        "/admin/devices/device/add/",
        {"name": "nx-new", "kind": "jetson-xavier-nx", "memory_gb": "", "gflops": "", "status": "offline"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    device = Device.objects.get(name="nx-new")
    assert device.gflops == KINDS["jetson-xavier-nx"].gflops
