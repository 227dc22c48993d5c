"""The site's side of fault tolerance: the job's state machine driven by its coordinator's events, the fleet of
agents the coordinator sees, staff's actions on running jobs (who may, what is checked, the audit), and the
agent messages that could forge a recovery. The runs themselves are in tests/e2e/test_recovery.py."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from engine.errors import UserError
from engine.events import DeviceLeft, DeviceLost, DeviceStandby, Eval, Recovered, Replan, Replay
from tests.webapp.test_agent_protocol import batch, talk
from tests.webapp.test_sockets import enrolled, running_job
from webapp.devices.models import Device
from webapp.jobs.coordinating import RemoteFleet, apply_event
from webapp.jobs.ingest import record_events
from webapp.jobs.models import Job, JobAction, JobDevice, JobEvent
from webapp.jobs.planning import pick_devices


@pytest.fixture
def job(bob):
    a, _ = enrolled("tx2-0")
    b, _ = enrolled("nx-0", "jetson-xavier-nx")
    job = running_job(bob, [a, b])
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now(), emulated=True)
    JobDevice.objects.filter(job=job).update(state="training")
    job.refresh_from_db()
    return job


def lines(job: Job) -> list[str]:
    return [e["message"] for e in JobEvent.objects.filter(job=job, type="log").values_list("data", flat=True)]


def test_a_loss_makes_the_job_recovering_and_the_first_new_iteration_running_again(job):
    apply_event(job.pk, DeviceLost("tx2-0", 4, "died (SIGKILL)", 0.4, 0).to_message())
    job.refresh_from_db()
    assert job.status == "recovering" and job.message == "recovering: tx2-0 lost during iteration 4"
    assert JobDevice.objects.get(job=job, name="tx2-0").state == "lost"
    new_plan = {**job.plan, "stages": job.plan["stages"][1:]}
    apply_event(job.pk, Replan(1, new_plan, 0.25, "lost", 90.0, 3).to_message())
    apply_event(job.pk, Replay(4, 4, 1).to_message())
    job.refresh_from_db()
    assert job.status == "recovering" and job.plan == new_plan
    # numbered by the engine, once over the run (the fixture's job never recorded its generation 0)
    assert [(g["generation"], g["reason"], g["start"]) for g in job.generations] == [(1, "lost", 3)]
    apply_event(job.pk, Recovered(1, 1.2, 0.3, summary="tx2-0 lost ...; recovered in 1.2 s", iteration=4).to_message())
    job.refresh_from_db()
    assert job.status == "running" and job.message == "training"
    assert lines(job) == [
        "device tx2-0 lost at iteration 4 (died (SIGKILL)); noticed in 0.4 s",
        "re-planned in 0.2 s (lost): generation 1, 1 stage on nx-0, 90.0 samples/s predicted",
        "rolled back: replaying iteration 4",
        "recovered: tx2-0 lost ...; recovered in 1.2 s",
    ]
    kinds = list(JobEvent.objects.filter(job=job).exclude(type="log").values_list("type", flat=True))
    assert kinds == ["device-lost", "replan", "replay", "recovered"]  # stored: the live page's marks come from them


def test_a_device_that_left_is_freed_and_a_finished_job_is_not_revived(job):
    apply_event(job.pk, DeviceLeft("nx-0", 3, 1).to_message())
    assert JobDevice.objects.get(job=job, name="nx-0").state == "left"
    assert Device.objects.get(name="nx-0").job is None and Device.objects.get(name="nx-0").status == "online"
    Job.objects.filter(pk=job.pk).update(status="cancelled")
    apply_event(job.pk, DeviceLost("tx2-0", 4, "died (SIGKILL)", 0.4, 0).to_message())
    assert Job.objects.get(pk=job.pk).status == "cancelled"


def test_a_device_a_re_plan_leaves_out_stands_by_free_and_says_why(job):
    """Issue 52, defect 2: a device the re-plan left out read "left ..., its layers handed over", with no reason."""
    apply_event(job.pk, DeviceStandby("nx-0", 3, 1, 1).to_message())
    assert JobDevice.objects.get(job=job, name="nx-0").state == "standby"
    assert Device.objects.get(name="nx-0").job is None and Device.objects.get(name="nx-0").status == "online"
    assert lines(job) == [
        "device nx-0 stands by after iteration 3: the re-plan found no faster plan that uses it (the new plan uses "
        "1 device); it is planned on again at the next change"
    ]
    sent("nx-0", {"type": "job-stopped", "device": "nx-0", "reason": "left"})  # its process exits after handing over
    assert JobDevice.objects.get(job=job, name="nx-0").state == "standby"


def sent(device: str, *events: dict, first: int = 1) -> None:
    """As the site stores a batch from `device`'s agent (webapp/agents/consumers.py)."""
    agent = Device.objects.get(name=device)
    items = [{"seq": first + k, "job": Job.objects.get().pk, "event": ev} for k, ev in enumerate(events)]
    record_events(agent, items)


def test_the_fleet_reads_exits_from_the_agents_reports(job):
    fleet = RemoteFleet(job.pk)
    sent("tx2-0", {"type": "device-start", "device": "tx2-0", "rank": 0, "stage": 0})
    sent("tx2-0", {"type": "job-stopped", "device": "tx2-0", "reason": "died", "why": "died (SIGKILL)"}, first=2)
    sent("nx-0", {"type": "job-stopped", "device": "nx-0", "reason": "left"})
    assert fleet.get(0.2)["type"] == "device-start"  # what the coordinator needs, in order
    assert fleet.get(0.05) is None  # job-stopped is an exit, not an event for it
    assert (fleet.exitcode("tx2-0"), fleet.why("tx2-0")) == (-9, "died (SIGKILL)")
    assert fleet.exitcode("nx-0") == 0  # let go by the coordinator


def test_each_event_reaches_the_coordinator_once_in_order_and_a_new_coordinator_reads_from_its_start(job):
    def iteration(k: int) -> dict:
        return {"type": "iteration", "iteration": k, "loss": 1.0, "iteration_s": 0.1, "throughput": 80.0,
                "steps": 4, "time": float(k)}  # fmt: skip

    Job.objects.filter(pk=job.pk).update(iterations=10)
    before = RemoteFleet(job.pk)
    sent("tx2-0", iteration(0), iteration(1))
    sent("tx2-0", iteration(0), iteration(1))  # sent again (no ack came): stored once, streamed again, read once
    sent("nx-0", Eval(1, 0.5, 0.9, None, 64, 0.2).to_message())  # read too: a score past chance's is a divergence
    after = RemoteFleet(job.pk)  # another coordinator takes the job over: what comes next is its
    sent("tx2-0", iteration(2), first=3)
    read = [(ev["type"], ev["iteration"]) for ev in before.drain()]
    assert read == [("iteration", 0), ("iteration", 1), ("eval", 1), ("iteration", 2)]
    assert [ev["iteration"] for ev in after.drain()] == [2]
    assert JobEvent.objects.filter(job=job, type="iteration").count() == 3
    Device.objects.filter(name="tx2-0").update(session="s2", last_seq=0)  # its agent restarted: seqs from 1 again
    sent("tx2-0", iteration(3))
    assert [ev["iteration"] for ev in after.drain()] == [3]


def test_a_standby_device_is_claimed_when_the_coordinator_starts_it(job):
    from engine.runtime.config import DeviceConfig
    from engine.runtime.coordinator import Coordinator  # noqa: F401  the fleet is what it spawns through
    from engine.runtime.options import RunOptions
    from webapp.jobs.models import read_plan

    cfg = DeviceConfig(read_plan(job.plan), None, 0, "127.0.0.1", 29500, RunOptions(generation=1), name="nano-0",
                       coordinated=True)  # fmt: skip
    for name in ("nano-0", "nano-1"):
        enrolled(name, "jetson-nano")
    Device.objects.filter(name__startswith="nano").update(status="online")
    fleet = RemoteFleet(job.pk)
    fleet.spawn("nano-0", None, cfg)
    row = JobDevice.objects.get(job=job, name="nano-0")
    assert row.state == "starting" and row.accepted and row.rank == 2
    assert Device.objects.get(name="nano-0").job_id == job.pk and fleet.exitcode("nano-0") is None
    Device.objects.filter(name="nano-1").update(status="disabled")
    fleet.spawn("nano-1", None, cfg)
    assert fleet.exitcode("nano-1") == 1 and "disabled, failed, removed or in another job" in fleet.why("nano-1")
    Job.objects.filter(pk=job.pk).update(status="cancelled")  # nothing is claimed for a job that ended
    Device.objects.filter(name="nano-1").update(status="online")
    fleet.spawn("nano-1", None, cfg)
    assert fleet.exitcode("nano-1") == 1 and Device.objects.get(name="nano-1").job_id is None


# -- staff's actions ---------------------------------------------------------------------------------------


def test_only_staff_act_on_a_running_job_and_each_action_is_audited(job, client, alice, bob):
    client.force_login(bob)
    refused = client.post(f"/api/jobs/{job.pk}/kill/", {"device": "tx2-0"}, content_type="application/json")
    assert refused.status_code == 403 and not JobAction.objects.exists()
    client.force_login(alice)
    for action in ("kill", "remove"):
        r = client.post(f"/api/jobs/{job.pk}/{action}/", {"device": "tx2-0"}, content_type="application/json")
        assert r.status_code == 200, r.json()
    assert [(a.kind, a.device, a.user.username) for a in JobAction.objects.all()] == [
        ("kill", "tx2-0", "alice"),
        ("remove", "tx2-0", "alice"),
    ]
    assert lines(job) == ["alice killed the process of device tx2-0 (SIGKILL)",
                          "alice asked to remove device tx2-0 from the job"]  # fmt: skip
    again = client.post(f"/api/jobs/{job.pk}/remove/", {"device": "tx2-0"}, content_type="application/json")
    assert again.status_code == 409 and again.json()["error"] == f"device tx2-0 is already leaving job {job.pk}"


@pytest.mark.parametrize(
    "action, device, error",
    [
        ("kill", "nano-9", "device 'nano-9' has no part in job {job}"),
        ("remove", "", 'send {{"device": "<name>"}}: the device to remove'),
        ("add", "tx2-0", "device tx2-0 is busy with job {job}: only an online, idle device can join a job"),
        ("add", "nope", "no device 'nope' is registered"),
    ],
)
def test_impossible_actions_are_one_clear_error(job, client, alice, action, device, error):
    client.force_login(alice)
    r = client.post(f"/api/jobs/{job.pk}/{action}/", {"device": device}, content_type="application/json")
    assert r.status_code in (400, 409) and r.json() == {"error": error.format(job=job.pk)}


def test_a_finished_job_takes_no_actions_and_the_last_device_cannot_leave(job, client, alice):
    client.force_login(alice)
    JobDevice.objects.filter(job=job, name="nx-0").update(state="lost")
    r = client.post(f"/api/jobs/{job.pk}/remove/", {"device": "tx2-0"}, content_type="application/json")
    assert r.status_code == 409 and "last device" in r.json()["error"]
    Job.objects.filter(pk=job.pk).update(status="completed")
    r = client.post(f"/api/jobs/{job.pk}/kill/", {"device": "tx2-0"}, content_type="application/json")
    assert r.status_code == 409 and "only while a job runs" in r.json()["error"]


def test_an_idle_device_added_to_a_running_job_takes_part_in_it(job, client, alice):
    extra, _ = enrolled("nano-0", "jetson-nano")
    Device.objects.filter(pk=extra.pk).update(status="online", measured={"emulated": True})
    client.force_login(alice)
    r = client.post(f"/jobs/{job.pk}/devices/add/", {"device": "nano-0"})  # the live page's form
    assert r.status_code == 302
    row = JobDevice.objects.get(job=job, name="nano-0")
    assert row.state == "assigned" and row.rank == 2 and Device.objects.get(pk=extra.pk).job_id == job.pk
    assert JobAction.objects.get(kind="add").user == alice


def test_disabling_a_busy_device_keeps_its_job_and_removing_it_is_a_graceful_leave(job, client, alice):
    client.force_login(alice)
    nx = Device.objects.get(name="nx-0")
    client.post(f"/devices/{nx.pk}/disable/")
    job.refresh_from_db()
    assert job.status == "running" and Device.objects.get(pk=nx.pk).status == "disabled"
    client.post(f"/devices/{nx.pk}/remove/")
    assert Device.objects.filter(pk=nx.pk).exists()  # it leaves the job first
    assert JobAction.objects.get(kind="remove").device == "nx-0"


def test_a_busy_device_being_removed_takes_no_new_job_once_it_has_left(job, client, alice):
    client.force_login(alice)
    nx = Device.objects.get(name="nx-0")
    r = client.post(f"/devices/{nx.pk}/remove/", follow=True)
    said = [str(m) for m in r.context["messages"]]
    assert said == [f"nx-0 leaves job {job.pk} at the next iteration boundary, its layers handed over, and is "
                    "disabled: it takes no new jobs. Remove it again once it has left to delete it, or enable it "
                    "to keep it."]  # fmt: skip
    device = Device.objects.get(pk=nx.pk)
    assert device.status == "disabled" and device.job_id == job.pk  # it goes on with its job until it leaves
    apply_event(job.pk, DeviceLeft("nx-0", 3, 1).to_message())
    device.refresh_from_db()
    assert device.job_id is None and device.status == "disabled" and not device.available  # was back online
    with pytest.raises(UserError, match=r"not online: nx-0 \(disabled\)"):
        pick_devices(["nx-0"])
    assert "nx-0" not in [d.name for d in Device.objects.all() if d.available]  # nor by a job naming none
    r = client.post(f"/devices/{nx.pk}/remove/", follow=True)
    assert not Device.objects.filter(pk=nx.pk).exists()
    assert [str(m) for m in r.context["messages"]] == ["nx-0 is removed."]


# -- messages --------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the agent socket's consumer reads the database from its own threads
def test_an_agent_cannot_forge_a_recovery_or_speak_for_another_device(job):
    _, credential = enrolled("tx2-9")
    Device.objects.filter(name="tx2-9").update(job=job)
    JobDevice.objects.create(job=job, device=Device.objects.get(name="tx2-9"), name="tx2-9", rank=5)
    forged = [
        {"type": "device-lost", "device": "nx-0", "iteration": 2, "cause": "x"},
        {"type": "recovered", "generation": 1, "real_s": 1.0, "device_s": 1.0},
        {"type": "restore", "device": "nx-0", "start": 0, "end": 3, "source": "seed", "copy": "seed", "iteration": 0},
    ]
    replies = talk(credential, json.dumps(batch(*forged, job=job.pk)))
    assert [r["type"] for r in replies] == ["error", "error", "ack"]  # each forged one said why, none stored
    stored = list(JobEvent.objects.filter(job=job).exclude(type="log").values_list("type", "device", "data"))
    assert [(t, d, e["device"]) for t, d, e in stored] == [("restore", "tx2-9", "tx2-9")]  # its own name
    assert Job.objects.get(pk=job.pk).status == "running"
