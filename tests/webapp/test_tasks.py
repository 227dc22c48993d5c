"""Celery tasks: the health check (silent devices go offline, which their job's coordinator sees; unaccepted
launches fail)."""

from datetime import timedelta

from django.utils import timezone

from webapp.devices.models import Device
from webapp.jobs.models import Job, JobDevice
from webapp.jobs.tasks import health_check, plan_job


def test_a_silent_device_goes_offline_and_its_coordinator_sees_it_gone_if_it_had_not_started(bob, cluster_c):
    from webapp.jobs.coordinating import RemoteFleet

    nx, tx2 = cluster_c[0], cluster_c[1]
    now = timezone.now()
    job = Job.objects.create(owner=bob, model="mobilenetv2", status="running", launched_at=now, started_at=now)
    for rank, d in enumerate((nx, tx2)):
        JobDevice.objects.create(job=job, device=d, name=d.name, rank=rank, state="training")
    Device.objects.filter(pk__in=[nx.pk, tx2.pk]).update(status="busy", job=job)
    fleet = RemoteFleet(job.pk)
    fleet.starting = {"tx2-0": [tx2.pk, {}, -1e9, -1e9], "nx-0": [nx.pk, {}, -1e9, -1e9]}  # told to start long ago
    assert fleet.exitcode("tx2-0") is None and fleet.exitcode("nx-0") is None
    Device.objects.filter(pk=tx2.pk).update(last_heartbeat=now - timedelta(seconds=16))
    assert health_check() == {"offline": 1, "unaccepted": 0, "started": 0}
    job.refresh_from_db()
    assert job.status == "running"  # the job's coordinator recovers without it, or fails the job
    assert job.events.filter(type="log", data__message="device tx2-0 stopped sending heartbeats (none for 15 s)")
    assert Device.objects.get(pk=tx2.pk).status == "offline"
    fleet.offline_checked = 0.0  # as if a second had passed
    assert fleet.exitcode("tx2-0") == 1 and fleet.why("tx2-0") == "its agent went offline"
    assert fleet.exitcode("nx-0") is None
    assert health_check() == {"offline": 0, "unaccepted": 0, "started": 0}


def test_a_device_whose_heartbeats_wait_for_the_database_is_not_taken_for_offline(cluster_c):
    """An overloaded site writes `last_heartbeat` late; the socket noted the heartbeat in Redis when it read it."""
    from asgiref.sync import async_to_sync

    from webapp.devices import liveness

    nx, tx2 = cluster_c[0], cluster_c[1]
    long_ago = timezone.now() - timedelta(seconds=60)
    Device.objects.filter(pk__in=[nx.pk, tx2.pk]).update(last_heartbeat=long_ago)
    async_to_sync(liveness.heard)(nx.pk)  # nx-0's agent is alive: its heartbeat was read just now
    assert set(liveness.last_heard([nx.pk, tx2.pk])) == {nx.pk}
    assert health_check() == {"offline": 1, "unaccepted": 0, "started": 0}
    assert Device.objects.get(pk=nx.pk).status == "online" and Device.objects.get(pk=tx2.pk).status == "offline"


def test_a_launch_nobody_accepts_fails(bob, cluster_c, settings):
    late = timezone.now() - timedelta(seconds=settings.ASTEROID_ACCEPT_TIMEOUT_S + 1)
    job = Job.objects.create(owner=bob, model="mobilenetv2", status="running", launched_at=late)
    JobDevice.objects.create(job=job, device=cluster_c[0], name="nx-0", rank=0, accepted=True)
    JobDevice.objects.create(job=job, device=cluster_c[3], name="nano-0", rank=1)
    assert health_check()["unaccepted"] == 1
    job.refresh_from_db()
    assert job.status == "failed" and job.message.startswith("device(s) nano-0 did not accept the job within 60 s")


def test_planning_runs_once(bob, cluster_c, profile_cache):
    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=32, iterations=2)
    assert plan_job(job.pk) == "planned"
    assert plan_job(job.pk) == "not queued"  # a redelivered task does nothing
    job.refresh_from_db()
    assert job.status == "planned" and job.progress == 1.0 and job.message.startswith("planned: ")


def test_a_real_board_beside_emulated_ones_gets_a_plan_that_launches(bob, cluster_c, profile_cache):
    """Issue 52, defect 3: with a real board enrolled beside the emulated cluster, a job naming no devices was
    planned on all of them and its launch refused ("the plan mixes emulated and real devices")."""
    from webapp.jobs.launching import launch
    from webapp.jobs.models import JobEvent

    Device.objects.create(name="board-0", kind="jetson-xavier-nx", status=Device.Status.ONLINE,
                          last_heartbeat=timezone.now(), measured={"emulated": False})  # fmt: skip
    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=32, iterations=2)
    assert plan_job(job.pk) == "planned"
    job.refresh_from_db()
    assert job.device_names == ["board-0"]  # the lab's real board, not a mix
    logged = [e.data["message"] for e in JobEvent.objects.filter(job=job, type="log")]
    assert any("not on the 6 emulated devices (emulated and real boards cannot share a run)" in m for m in logged)
    launch(job)  # it launches: no mix
    assert Job.objects.get(pk=job.pk).status == "running" and not Job.objects.get(pk=job.pk).emulated


def test_devices_named_of_both_kinds_are_refused_at_planning(bob, cluster_c):
    Device.objects.create(name="board-0", kind="jetson-nano", status=Device.Status.ONLINE, measured={})
    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=32, iterations=2,
                             requested_devices=["nx-0", "board-0"])  # fmt: skip
    assert plan_job(job.pk) == "failed"
    job.refresh_from_db()
    assert job.message == "nx-0 is emulated and board-0 is real: they cannot share a run; pick devices of one kind"


def test_a_job_held_to_a_schedule_is_planned_and_run_under_it(bob, cluster_c, profile_cache):
    from webapp.jobs.coordinating import run_options

    job = Job.objects.create(owner=bob, model="mobilenetv2", batch_size=64, iterations=2, options={"schedule": "zb-h1"})
    assert plan_job(job.pk) == "planned"
    job.refresh_from_db()
    assert len(job.plan["stages"]) > 1 and job.plan["schedule"] == "zb-h1"
    assert all(p.get("schedule") == "zb-h1" for p in job.comparison.values() if "error" not in p)
    assert run_options(job).schedule == "zb-h1"  # what the coordinator re-plans under after a loss
    assert job.to_dict()["schedule"] == "zb-h1"


def test_a_compressed_job_is_planned_at_its_level(bob, cluster_c, profile_cache):
    job = Job.objects.create(
        owner=bob, model="mobilenetv2", batch_size=64, iterations=2, bandwidth_mbps=1000, compression="4"
    )
    assert plan_job(job.pk) == "planned"
    job.refresh_from_db()
    stages = job.plan["stages"]
    assert len(stages) > 1  # cluster C at 1000 Mbps: a pipeline, so there are boundaries to compress
    assert job.plan["compression"] == [4] * (len(stages) - 1)
    assert job.to_dict()["compression"] == "4"


def test_a_job_sending_changes_of_activations_keeps_its_datasets_samples_and_re_plans_so(bob, cluster_c, profile_cache):
    from engine.compression import plan_compression
    from engine.plan import Plan

    job = Job.objects.create(
        owner=bob, model="mobilenetv2", dataset="digits", batch_size=64, iterations=2, bandwidth_mbps=1000,
        compression="delta:2",
    )  # fmt: skip
    assert plan_job(job.pk) == "planned"
    job.refresh_from_db()
    assert job.plan["compression"] == [2] * (len(job.plan["stages"]) - 1)
    assert job.plan["delta_samples"] == 1438  # digits' training split: every sample kept, once per pair
    plan = Plan.from_dict(job.plan)
    assert plan_compression(plan.compression, plan.delta) == "delta:2"  # what the coordinator re-plans with


def test_a_lab_of_heartbeats_at_once_is_noted(db):
    """Hundreds of agents' heartbeats read in the same instant: each is noted (the async Redis pool refused the
    101st connection by default, and the refusal closed that agent's socket)."""
    import asyncio

    from asgiref.sync import async_to_sync

    from webapp.devices import liveness

    async def lab():
        await asyncio.gather(*(liveness.heard(i) for i in range(1, 301)))

    async_to_sync(lab)()
    assert len(liveness.last_heard(list(range(1, 301)))) == 300
