"""Devices' health over time: heartbeats bring each board's CPU, memory, temperature, GPU and power figures; the
site keeps them (with a job's, as long as the job) and shows them on the devices and live pages (issue 52)."""

import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from django.utils import timezone

from tests.webapp.test_rounds import _welcomed
from tests.webapp.test_sockets import enrolled, running_job, say
from webapp.devices import health
from webapp.devices.models import HealthSample

pytestmark = pytest.mark.django_db(transaction=True)

FIGURES = {"cpu": 41.5, "mem_used": 3 * 2**30, "mem_total": 4 * 2**30, "temp_c": 48.0, "gpu": 70.0, "power_w": 6.5}


def test_heartbeats_bring_health_which_the_pages_show_and_a_job_keeps(bob, carol):
    (_, idle_credential), (busy, busy_credential) = enrolled("tx2-0"), enrolled("tx2-1")
    job = running_job(bob, [busy])

    async def run():
        agents = await _welcomed([idle_credential, busy_credential])
        await agents[0].send_json_to({"type": "heartbeat", "state": "idle", "job": None, "health": FIGURES})
        await agents[1].send_json_to({"type": "heartbeat", "state": "busy", "job": job.pk, "health": {"cpu": 90.0}})
        bad = {"type": "heartbeat", "state": "idle", "health": {"cpu": 150}}
        assert "health figure 'cpu' must be a number from 0 to 100" in (await say(agents[0], bad))["message"]
        unknown = {"type": "heartbeat", "state": "idle", "health": {"fans": 3}}
        assert "unknown health figure 'fans'" in (await say(agents[0], unknown))["message"]
        for ws in agents:
            await ws.disconnect()

    async_to_sync(run)()
    rows = {s.device.name: s for s in HealthSample.objects.select_related("device")}
    assert rows["tx2-0"].cpu == 41.5 and rows["tx2-0"].mem_percent == 75.0 and rows["tx2-0"].job is None
    assert rows["tx2-1"].cpu == 90.0 and rows["tx2-1"].job_id == job.pk and rows["tx2-1"].mem_used is None
    client = Client()
    client.force_login(bob)
    page = client.get("/devices/").content.decode()
    assert "CPU 42 %" in page and "mem 75 %" in page and "GPU 70 %" in page and "48 °C" in page and "6.5 W" in page
    assert '<polyline class="spark-cpu" points="' in page
    doc = client.get(f"/jobs/{job.pk}/health.json").json()
    assert [t["name"] for t in doc["figure"]["data"]] == ["tx2-1 CPU"] and doc["summary"] == "Latest — tx2-1: CPU 90 %."
    other = Client()
    other.force_login(carol)
    assert other.get(f"/jobs/{job.pk}/health.json").status_code == 404
    # a day later the idle board's sample is pruned; the job's stays with the job, and goes with it
    HealthSample.objects.update(at=timezone.now() - timezone.timedelta(hours=25))
    assert health.prune() == 1 and list(HealthSample.objects.values_list("job_id", flat=True)) == [job.pk]
    job.delete()
    assert not HealthSample.objects.exists()


def test_each_devices_agent_lines_about_a_job_are_kept_shown_and_downloaded(bob, carol):
    from webapp.jobs.ingest import record_events

    device, _ = enrolled("tx2-0")
    job = running_job(bob, [device])
    line = {"type": "agent-log", "device": "whatever-it-calls-itself", "severity": "WARNING",
            "message": f"job {job.pk}: device tx2-0 failed: out of memory", "time": 1_700_000_000.0}  # fmt: skip
    record_events(device, [{"seq": 1, "job": job.pk, "event": line}])
    job.status = "completed"
    job.save(update_fields=["status"])
    late = {**line, "severity": "INFO", "message": f"job {job.pk}: finished (done)", "time": 1_700_000_001.0}
    record_events(device, [{"seq": 2, "job": job.pk, "event": late}])  # after the end: kept all the same
    client = Client()
    client.force_login(bob)
    text = client.get(f"/jobs/{job.pk}/logs/", {"device": "tx2-0"}).content.decode()
    assert text == (f"2023-11-14 22:13:20 tx2-0 WARNING job {job.pk}: device tx2-0 failed: out of memory\n"
                    f"2023-11-14 22:13:21 tx2-0 INFO job {job.pk}: finished (done)\n")  # fmt: skip
    assert client.get(f"/jobs/{job.pk}/logs/", {"device": "nx-9"}).content == b""
    download = client.get(f"/jobs/{job.pk}/logs/", {"download": "1", "device": "tx2-0"})
    assert download["Content-Disposition"] == f'attachment; filename="asteroid-job{job.pk}-tx2-0.log"'
    log_lines = [d["message"] for d in job.events.filter(type="log").values_list("data", flat=True)]
    assert not any("out of memory" in m for m in log_lines)  # the board's own account, not the job's log
    other = Client()
    other.force_login(carol)
    assert other.get(f"/jobs/{job.pk}/logs/").status_code == 404
