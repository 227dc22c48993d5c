"""Devices: staff add one and get its agent command once; enrollment is single use; staff-only management."""

import json
import re

from django.test import Client

from webapp.devices.models import Device
from webapp.lib.tokens import token_hash


def test_staff_adds_a_device_and_sees_the_command_once(client, alice, settings):
    # The command names the site's configured URL (ASTEROID_HOST / ASTEROID_SITE_URL), which boards reach, not the
    # Host the administrator's browser used (regression: it named http://127.0.0.1:8000 to every board).
    settings.ASTEROID_SITE_URL = "http://198.18.42.1:8000"
    client.force_login(alice)
    page = client.post("/devices/add/", {"name": "nano-lab-1", "kind": "jetson-nano"}).content.decode()
    command = re.search(r'<pre class="command" id="agent-command">([^<]+)</pre>', page).group(1)
    # make agent runs it with the checkout's Python: a board's own `python` lacks the packages
    assert command.startswith("make agent SERVER=http://198.18.42.1:8000 TOKEN=ast_enroll_")
    token = command.rsplit("TOKEN=", 1)[1]
    device = Device.objects.get(name="nano-lab-1")
    assert device.enrollment_hash == token_hash(token) and token not in str(Device.objects.values())
    assert token not in client.get("/devices/").content.decode()  # shown once


def test_enrollment_is_single_use_and_gives_a_credential(alice):
    device = Device.objects.create(name="tx2-lab", kind="jetson-tx2")
    token = device.issue_enrollment()
    client = Client()
    response = client.post("/api/agent/enroll/", {"token": token}, content_type="application/json")
    assert response.status_code == 200
    credential = response.json()["credential"]
    assert response.json()["device"]["name"] == "tx2-lab" and Device.for_credential(credential) == device
    again = client.post("/api/agent/enroll/", {"token": token}, content_type="application/json")
    assert again.status_code == 403 and "already used" in again.json()["error"]
    assert client.post("/api/agent/enroll/", "nope", content_type="application/json").status_code == 400


def test_new_token_revokes_the_credential(alice):
    device = Device.objects.create(name="nx-lab", kind="jetson-xavier-nx")
    _, credential = Device.enroll(device.issue_enrollment())
    client = Client()
    client.force_login(alice)
    doc = client.post(f"/api/devices/{device.pk}/token/").json()
    assert doc["enrollment_token"].startswith("ast_enroll_") and doc["command"].endswith(doc["enrollment_token"])
    assert Device.for_credential(credential) is None


def test_only_staff_manage_devices(client, bob):
    device = Device.objects.create(name="nano-x", kind="jetson-nano")
    client.force_login(bob)
    assert client.get("/devices/").status_code == 200
    assert client.get("/devices/add/").status_code == 403
    for action in ("token", "disable", "remove"):
        assert client.post(f"/devices/{device.pk}/{action}/").status_code == 403
    assert client.post("/api/devices/", {"name": "x"}, content_type="application/json").status_code == 403
    assert client.post(f"/api/devices/{device.pk}/token/").status_code == 403
    assert Device.objects.get(pk=device.pk).enrollment_hash == ""


def test_api_adds_devices_with_clear_errors(client, alice):
    client.force_login(alice)
    created = client.post("/api/devices/", {"name": "nano-7", "kind": "jetson-nano"}, content_type="application/json")
    assert created.status_code == 201 and created.json()["device"]["memory_gb"] == 4.0
    dup = client.post("/api/devices/", {"name": "nano-7"}, content_type="application/json")
    assert dup.status_code == 400 and dup.json()["error"].startswith("name: Device with this Name already exists")
    custom = client.post("/api/devices/", {"name": "rig", "kind": "custom"}, content_type="application/json")
    assert custom.status_code == 400 and "Required for a custom device" in json.dumps(custom.json())
    listed = client.get("/api/devices/").json()["devices"]
    assert [d["name"] for d in listed] == ["nano-7"] and listed[0]["enrolled"] is False


def test_absurd_memory_or_speed_names_the_field_and_range(client, alice):
    client.force_login(alice)
    for field, value in [("memory_gb", 1e306), ("gflops", 1e306), ("memory_gb", 0), ("gflops", "fast")]:
        body = {"name": "rig", "kind": "custom", "memory_gb": 8, "gflops": 100, field: value}
        response = client.post("/api/devices/", body, content_type="application/json")
        assert response.status_code == 400, (field, value, response.content)
        assert response.json()["error"].startswith(f"{field}: Must be a number from 0.1 to "), response.json()
    page = client.post("/devices/add/", {"name": "rig", "kind": "custom", "memory_gb": "1e306", "gflops": 100})
    assert page.status_code == 200 and "Must be a number from 0.1 to 1024." in page.content.decode()
    assert not Device.objects.exists()


def test_unknown_device_is_a_json_404(client, alice):
    client.force_login(alice)  # was Django's HTML 404 page
    response = client.post("/api/devices/999/token/")
    assert response.status_code == 404 and response.json() == {"error": "no device 999"}


def test_disable_and_enable(client, alice):
    device = Device.objects.create(name="nano-9", kind="jetson-nano", status="online")
    client.force_login(alice)
    client.post(f"/devices/{device.pk}/disable/")
    assert Device.objects.get(pk=device.pk).status == "disabled"
    client.post(f"/devices/{device.pk}/enable/")
    assert Device.objects.get(pk=device.pk).status == "offline"
    client.post(f"/devices/{device.pk}/remove/")
    assert not Device.objects.filter(pk=device.pk).exists()


def test_part_upload_needs_the_device_credential(bob, settings):
    from django.utils import timezone

    from webapp.jobs.models import Job, JobDevice

    device = Device.objects.create(name="nano-3", kind="jetson-nano")
    _, credential = Device.enroll(device.issue_enrollment())
    job = Job.objects.create(owner=bob, model="mobilenetv2", status="running", launched_at=timezone.now())
    JobDevice.objects.create(job=job, device=device, name="nano-3", rank=1)
    client = Client()
    url = f"/api/agent/jobs/{job.pk}/part/"
    assert client.post(url, b"x", content_type="application/octet-stream").status_code == 401
    settings.ASTEROID_MAX_PART_BYTES = 10
    too_big = client.post(
        url, b"y" * 11, content_type="application/octet-stream", HTTP_AUTHORIZATION=f"Bearer {credential}"
    )
    assert too_big.status_code == 413
    ok = client.post(
        url, b"weights", content_type="application/octet-stream", HTTP_AUTHORIZATION=f"Bearer {credential}"
    )
    assert ok.json() == {"stored": 7}
    assert (settings.ASTEROID_JOBS_DIR / str(job.pk) / "part-1.pt").read_bytes() == b"weights"


def test_a_probed_device_is_marked_on_the_list(client, bob):
    Device.objects.create(name="orin-0", kind="custom", memory_gb=16, gflops=900, measured={"probe": {"x": [1, 2]}})
    Device.objects.create(name="nano-0", kind="jetson-nano")
    client.force_login(bob)
    rows = {r.split("</td>")[0].rsplit(">", 1)[1]: r for r in client.get("/devices/").content.decode().split("<tr")[1:]}
    assert ">probed</span>" in rows["orin-0"] and "probed" not in rows["nano-0"]


def test_the_devices_page_rereads_its_rows_with_new_devices_and_enrollments(client, alice):
    client.force_login(alice)
    page = client.get("/devices/").content.decode()
    assert 'id="device-table"' in page and "?rows=1" in page
    device = Device.objects.create(name="nano-new", kind="jetson-nano")
    token = device.issue_enrollment()
    rows = client.get("/devices/?rows=1").content.decode()
    assert "<html" not in rows and f'data-device-id="{device.pk}"' in rows and "not enrolled" in rows
    Device.enroll(token)
    Device.objects.filter(pk=device.pk).update(measured={"link_mbps": 19.5})
    rows = client.get("/devices/?rows=1").content.decode()
    assert "not enrolled" not in rows and ">20</td>" in rows  # its measured link
    device.delete()
    assert "nano-new" not in client.get("/devices/?rows=1").content.decode()


def test_the_devices_page_says_where_each_board_computes(client, bob):
    # what each agent said on hello (workers.probe.Capacity): a Jetson's GPU, a CPU-only board, one not yet heard
    orin = {"compute": "cuda", "gpu": "Orin", "gpu_memory": 7_400_000_000}
    Device.objects.create(name="orin-0", kind="jetson-xavier-nx", measured=orin)
    Device.objects.create(name="pi-0", kind="jetson-nano", measured={"compute": "cpu"})
    Device.objects.create(name="new-0", kind="jetson-nano")
    client.force_login(bob)
    page = client.get("/devices/").content.decode()
    rows = {re.search(r"<td>([\w-]+)", row).group(1): row for row in page.split("<tr data-device-id")[1:]}
    shown = {name: re.findall(r'data-field="compute"[^>]*>([^<]+)<', row) for name, row in rows.items()}
    assert shown == {"orin-0": ["GPU Orin (7.4 GB)"], "pi-0": ["CPU"], "new-0": []}, shown
