"""The job queue: a job launched on busy devices waits in line instead of being refused, and starts by itself, in
order, once they are free; staff reorder the line, owners cancel (issue 52, "a job queue")."""

import pytest
from django.test import Client

from webapp.jobs import ending, queue
from webapp.jobs.models import Job
from webapp.jobs.tasks import health_check

pytestmark = pytest.mark.django_db


def planned_on(owner, names: list[str]) -> Job:
    plan = {"method": "asteroid", "model": "mobilenetv2", "batch_size": 8, "micro_batches": 1,
            "stages": [{"layers": [0, 1], "devices": [{"name": n, "samples": 8}]} for n in names],
            "cluster": {"devices": [{"name": n, "kind": "nx"} for n in names]},
            "predicted": {"throughput": 100.0, "iteration_s": 0.08, "bubble_fraction": 0.0, "memory_bytes": {},
                          "fits": True}}  # fmt: skip
    return Job.objects.create(owner=owner, model="mobilenetv2", plan=plan, status="planned", iterations=2)


def api(user, path, body=None):
    client = Client()
    client.force_login(user)
    return client.post(path, body or {}, content_type="application/json")


def test_a_job_on_busy_devices_waits_in_line_and_starts_when_they_are_free(
    cluster_c, bob, carol, alice, django_capture_on_commit_callbacks
):
    first = planned_on(bob, ["nx-0", "tx2-0"])
    assert api(bob, f"/api/jobs/{first.pk}/launch/").json()["status"] == "running"
    second, third = planned_on(carol, ["tx2-0"]), planned_on(bob, ["nx-0", "tx2-1"])
    answer = api(carol, f"/api/jobs/{second.pk}/launch/")
    assert answer.status_code == 202, answer.content
    doc = answer.json()
    assert doc["status"] == "waiting" and doc["place_in_line"] == 1
    assert doc["message"] == f"waiting in line for tx2-0 (busy with job {first.pk})"
    assert api(bob, f"/api/jobs/{third.pk}/launch/").json()["place_in_line"] == 2
    # staff move the third ahead; a user may not
    assert api(carol, f"/api/jobs/{second.pk}/queue/", {"move": "down"}).status_code == 403
    assert api(alice, f"/api/jobs/{third.pk}/queue/", {"move": "first"}).json()["place_in_line"] == 1
    assert api(alice, f"/api/jobs/{third.pk}/queue/", {"move": "sideways"}).status_code == 400
    # the first job ends: the third (first in line) starts; the second, whose tx2-0 is free too, was not behind
    # the third for it, so it starts as well
    with django_capture_on_commit_callbacks(execute=True):
        ending.cancel(first)
    third.refresh_from_db(), second.refresh_from_db()
    assert third.status == "running" and third.queue_position is None
    assert second.status == "running"
    lines = [e["message"] for e in third.events.filter(type="log").values_list("data", flat=True)]
    assert any("launched from the queue" in line for line in lines), lines


def test_a_job_never_overtakes_an_earlier_one_waiting_for_the_same_device(cluster_c, bob):
    running = planned_on(bob, ["nx-0"])
    first, second = planned_on(bob, ["nx-0", "tx2-0"]), planned_on(bob, ["tx2-0"])
    api(bob, f"/api/jobs/{running.pk}/launch/")
    assert api(bob, f"/api/jobs/{first.pk}/launch/").status_code == 202
    assert api(bob, f"/api/jobs/{second.pk}/launch/").status_code == 202  # tx2-0 is idle, but the first waits for it
    other = planned_on(bob, ["tx2-1"])  # a device nobody in line waits for: it runs now
    assert api(bob, f"/api/jobs/{other.pk}/launch/").status_code == 200
    Job.objects.filter(pk=running.pk).update(status="completed")  # its end cut short: the health check frees nx-0
    assert health_check()["started"] == 1 and Job.objects.get(pk=first.pk).status == "running"
    waiting = Job.objects.get(pk=second.pk)
    assert waiting.status == "waiting" and waiting.message == f"waiting in line for tx2-0 (busy with job {first.pk})"
    Job.objects.filter(pk=first.pk).update(status="completed")
    assert health_check()["started"] == 1 and Job.objects.get(pk=second.pk).status == "running"


def test_a_waiting_job_is_cancelled_out_of_the_line_and_the_list_shows_the_line(cluster_c, bob, carol):
    running, waiting = planned_on(bob, ["nx-0"]), planned_on(bob, ["nx-0"])
    api(bob, f"/api/jobs/{running.pk}/launch/")
    client = Client()
    client.force_login(bob)
    page = client.post(f"/jobs/{waiting.pk}/launch/", follow=True).content.decode()
    assert f"Job {waiting.pk} is 1st in line: waiting in line for nx-0 (busy with job {running.pk})" in page
    listing = client.get("/jobs/").content.decode()
    assert 'id="waiting"' in listing and "(1 in line)" in listing
    assert "1st in line for its devices." in client.get(f"/jobs/{waiting.pk}/").content.decode()  # and a Cancel
    assert "Its place in line: 1" in client.get(f"/jobs/{waiting.pk}/live/").content.decode()
    other = Client()
    other.force_login(carol)
    assert 'id="waiting"' not in other.get("/jobs/").content.decode()  # not hers
    assert other.post(f"/jobs/{waiting.pk}/queue/up/").status_code in (302, 403)  # staff only
    assert api(bob, f"/api/jobs/{waiting.pk}/cancel/").json()["status"] == "cancelled"
    assert queue.waiting() == []


def test_a_job_asks_for_a_group_or_any_n_devices_instead_of_names(cluster_c, bob, profile_cache,
                                                                  django_capture_on_commit_callbacks):  # fmt: skip
    from engine.errors import UserError
    from webapp.devices.models import Device
    from webapp.jobs.forms import JobForm
    from webapp.jobs.planning import pick_devices

    Device.objects.filter(name__in=["tx2-0", "tx2-1", "nx-0"]).update(group="fast")
    base = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 64, "iterations": 2, "bandwidth_mbps": 1000}
    assert dict(JobForm().fields["device_group"].choices) == {"": "any", "fast": "fast"}
    form = JobForm({**base, "devices": ["nx-0"], "device_count": 2})
    assert form.errors["devices"] == ["Tick devices, or ask for a group or a number of them, not both."]
    assert JobForm({**base, "device_group": "fast", "device_count": 4}).errors["device_count"] == [
        "At most 3: the devices online in the group."
    ]
    assert {d.name for d in pick_devices([], "synthetic", "fast")[0]} == {"tx2-0", "tx2-1", "nx-0"}
    Device.objects.filter(name="nx-0").update(status="busy")  # the idle ones first, the fastest first
    assert [d.name for d in pick_devices([], "synthetic", "fast", 2)[0]] == ["tx2-0", "tx2-1"]
    assert [d.name for d in pick_devices([], "synthetic", "", 1)[0]] == ["tx2-0"]
    with pytest.raises(UserError, match="no device is in group 'slow'"):
        pick_devices([], "synthetic", "slow")
    with pytest.raises(UserError, match="4 devices asked for, but only 3 of one kind in group fast"):
        pick_devices([], "synthetic", "fast", 4)
    Device.objects.filter(name="nx-0").update(status="online")
    client = Client()
    client.force_login(bob)
    with django_capture_on_commit_callbacks(execute=True):
        doc = client.post("/api/jobs/", {**base, "device_count": 2}, content_type="application/json").json()
    job = Job.objects.get(pk=doc["id"])
    assert job.status == "planned" and job.device_count == 2 and len(job.plan_object.cluster.devices) == 2
    assert job.left_out["nano-0"] == "not among the 2 devices asked for (the idle ones first, the fastest first)"


def test_a_job_launched_later_does_not_take_an_idle_device_a_job_in_line_waits_for(cluster_c, bob):
    """Found trying it: Z waited for tx2-1 (busy) and nano-0 (idle); W, launched later on nano-0 alone, started."""
    x, z, w = planned_on(bob, ["tx2-1"]), planned_on(bob, ["tx2-1", "nano-0"]), planned_on(bob, ["nano-0"])
    api(bob, f"/api/jobs/{x.pk}/launch/")
    assert api(bob, f"/api/jobs/{z.pk}/launch/").status_code == 202
    doc = api(bob, f"/api/jobs/{w.pk}/launch/").json()
    assert doc["status"] == "waiting" and doc["message"] == "waiting in line for nano-0 (promised to a job ahead)"
    Job.objects.filter(pk=x.pk).update(status="completed")
    health_check()  # x's end frees tx2-1: z starts first, then w waits for nano-0, busy with z
    assert Job.objects.get(pk=z.pk).status == "running"
    assert Job.objects.get(pk=w.pk).message == f"waiting in line for nano-0 (busy with job {z.pk})"
