"""Job history: pages of the list, archive and delete, run again, and jobs compared side by side."""

import pytest
from django.utils import timezone

from webapp.jobs.models import Job, JobEvent

pytestmark = pytest.mark.django_db

PLAN = {"method": "asteroid", "model": "mobilenetv2", "batch_size": 8, "micro_batches": 1,
        "stages": [{"layers": [0, 3], "devices": [{"name": "nx-0", "samples": 8}]}],
        "cluster": {"devices": [{"name": "nx-0", "kind": "nx"}]},
        "predicted": {"throughput": 10.0, "iteration_s": 0.8, "bubble_fraction": 0.0, "memory_bytes": {},
                      "fits": True}}  # fmt: skip


def finished(owner, **fields) -> Job:
    now = timezone.now()
    base = {"owner": owner, "model": "mobilenetv2", "plan": PLAN, "status": "completed", "launched_at": now,
            "started_at": now, "finished_at": now, "iterations": 3}  # fmt: skip
    return Job.objects.create(**{**base, **fields})


def iterations(job: Job, losses: list[float], throughput: float) -> None:
    for k, loss in enumerate(losses):
        data = {"type": "iteration", "iteration": k, "loss": loss, "iteration_s": 0.8, "throughput": throughput,
                "measured_throughput": throughput}  # fmt: skip
        JobEvent.objects.create(job=job, type="iteration", data=data)
    Job.objects.filter(pk=job.pk).update(latest=data)


def test_the_list_pages_past_fifty_and_keeps_archived_jobs_apart(client, bob):
    jobs = [finished(bob) for _ in range(53)]
    client.force_login(bob)
    first = client.get("/jobs/").content.decode()
    assert first.count('<tr data-job="') == 50 and "page 1 of 2 (53 jobs)" in first
    second = client.get("/jobs/?page=2").content.decode()
    assert second.count('<tr data-job="') == 3 and f'data-job="{jobs[0].pk}"' in second  # the oldest last
    assert client.get("/jobs/?page=nonsense").status_code == 200
    response = client.post(f"/jobs/{jobs[0].pk}/archive/", follow=True)
    assert f"Job {jobs[0].pk} archived." in response.content.decode()
    assert f'data-job="{jobs[0].pk}"' not in client.get("/jobs/?page=2").content.decode()
    archived = client.get("/jobs/?archived=1").content.decode()
    assert archived.count('<tr data-job="') == 1 and "1 archived" in client.get("/jobs/").content.decode()
    client.post(f"/jobs/{jobs[0].pk}/archive/")  # and back
    assert not Job.objects.get(pk=jobs[0].pk).archived


def test_a_running_job_is_neither_archived_nor_deleted_and_others_jobs_are_out_of_reach(client, bob, carol):
    running = finished(bob, status="running", finished_at=None)
    client.force_login(bob)
    said = client.post(f"/jobs/{running.pk}/delete/", follow=True).content.decode()
    assert "cancel it first" in said and Job.objects.filter(pk=running.pk).exists()
    assert "archive it once it has ended" in client.post(f"/jobs/{running.pk}/archive/", follow=True).content.decode()
    client.force_login(carol)
    assert client.post(f"/jobs/{running.pk}/delete/").status_code == 404
    assert client.post(f"/jobs/{running.pk}/again/").status_code == 404
    assert client.get("/jobs/", {"jobs": [running.pk]}).status_code == 200


def test_deleting_a_job_takes_its_events_and_files(client, bob, settings):
    job = finished(bob)
    iterations(job, [2.0], 5.0)
    folder = settings.ASTEROID_JOBS_DIR / str(job.pk)
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    client.force_login(bob)
    response = client.post(f"/jobs/{job.pk}/delete/", follow=True)
    assert f"Job {job.pk} deleted" in response.content.decode()
    assert not Job.objects.filter(pk=job.pk).exists() and not JobEvent.objects.filter(job_id=job.pk).exists()
    assert not folder.exists()


def test_run_again_makes_a_new_job_of_the_same_settings(
    client, bob, cluster_c, profile_cache, django_capture_on_commit_callbacks
):
    old = finished(bob, dataset="digits", batch_size=32, iterations=7, bandwidth_mbps=200.0, compression="4",
                   options={"lr": 0.02, "schedule": "zb-h2"}, requested_devices=["nx-0", "tx2-0"])  # fmt: skip
    client.force_login(bob)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/jobs/{old.pk}/again/")
    new = Job.objects.exclude(pk=old.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{new.pk}/"
    same = ("model", "dataset", "batch_size", "iterations", "option_values", "bandwidth_mbps", "compression",
            "requested_devices")  # fmt: skip
    assert all(getattr(new, k) == getattr(old, k) for k in same), [(k, getattr(new, k)) for k in same]
    assert new.owner == bob and new.status == "planned" and new.device_names  # planned afresh


def test_jobs_compared_side_by_side(client, bob, carol):
    a, b = finished(bob), finished(bob, options={"lr": 0.1})
    iterations(a, [2.0, 1.5, 1.2], 40.0)
    iterations(b, [2.0, 1.1, 0.7], 55.0)
    client.force_login(bob)
    page = client.get("/jobs/compare/", {"jobs": [a.pk, b.pk]}).content.decode()
    assert f"Job {a.pk}" in page and f"Job {b.pk}" in page
    assert "40.0" in page and "55.0" in page and "1.2000" in page and "0.7000" in page
    assert 'id="fig-compare-throughput"' in page and 'id="fig-compare-loss"' in page
    assert f"job {a.pk}" in page  # the traces' names in the figures' JSON
    # one job, someone else's, or nonsense: back to the list with the reason
    for query in ({"jobs": [a.pk]}, {"jobs": ["x"]}):
        assert client.get("/jobs/compare/", query).status_code == 302
    client.force_login(carol)
    assert "Tick 2 to" in client.get("/jobs/compare/", {"jobs": [a.pk, b.pk]}, follow=True).content.decode()


def test_a_job_number_past_the_database_range_is_an_unknown_job_not_a_500(client, bob):
    # regression: ?jobs=1&jobs=99999999999999999999999 raised OverflowError (HTTP 500) in the database driver
    a, b = finished(bob), finished(bob)
    client.force_login(bob)
    huge = "9" * 23
    refused = client.get("/jobs/compare/", {"jobs": [a.pk, huge]}, follow=True)
    assert refused.status_code == 200 and "Tick 2 to" in refused.content.decode()
    page = client.get("/jobs/compare/", {"jobs": [a.pk, b.pk, huge, str(2**63)]})
    assert page.status_code == 200 and f"Job {a.pk}" in page.content.decode()


def test_the_list_shows_the_measured_figure_of_the_live_page_and_progress(client, bob):
    job = finished(bob)
    iterations(job, [2.0, 1.5, 1.2], 40.0)
    Job.objects.filter(pk=job.pk).update(latest={**job.latest, "iteration": 2, "throughput": 99.0,
                                                 "measured_throughput": 41.5})  # fmt: skip
    running = finished(bob, status="running", finished_at=None, iterations=10,
                       started_at=timezone.now() - timezone.timedelta(seconds=40),
                       latest={"iteration": 3, "throughput": 30.0, "measured_throughput": 31.0})  # fmt: skip
    reported(running, range(4), at=None)  # in one batch: the whole run's pace
    client.force_login(bob)
    page = client.get("/jobs/").content.decode()
    assert "41.5" in page and "99.0" not in page  # the run's median iteration, not the last one
    assert '<progress max="10" value="4">' in page and "4 / 10" in page
    assert Job.objects.get(pk=running.pk).eta_s == pytest.approx(60, abs=2)  # 40 s for 4 of 10


def reported(job: Job, numbers, at: float | None, every: float = 2.0) -> None:
    """Iteration reports of `numbers`, the first `at` seconds ago and `every` seconds apart (None: all now)."""
    now = timezone.now()
    for i, k in enumerate(numbers):
        ev = JobEvent.objects.create(job=job, type="iteration", data={"type": "iteration", "iteration": k})
        if at is not None:
            when = now - timezone.timedelta(seconds=at - i * every)
            JobEvent.objects.filter(pk=ev.pk).update(created_at=when)


def test_the_time_left_counts_a_replay_as_work_rather_than_going_stale(bob):
    """Issue 52, defect 4: during a replay after a recovery the time left stayed where it was ("about 104 s left"
    for two minutes). Iterations 0-11 at 2 s each, then a recovery replays 8, 9, 10: 29 iterations are left."""
    job = finished(bob, status="running", finished_at=None, iterations=40,
                   started_at=timezone.now() - timezone.timedelta(seconds=60))  # fmt: skip
    reported(job, [*range(12), 8, 9, 10], at=40)
    assert job.eta_s == pytest.approx(2.0 * 29, rel=0.01)
    reported(job, [11, 12], at=10)  # the replay goes on: less is left
    assert job.eta_s == pytest.approx(2.0 * 27, rel=0.01)
    Job.objects.filter(pk=job.pk).update(status="completed")
    assert Job.objects.get(pk=job.pk).eta_s is None


def test_each_iteration_tells_the_page_the_time_left(bob, monkeypatch):
    from tests.webapp.test_sockets import enrolled, running_job
    from webapp.jobs import notify
    from webapp.jobs.ingest import record_events

    sent = []
    monkeypatch.setattr(notify, "try_group_send", lambda group, kind, message: sent.append(message))
    device, _ = enrolled()
    job = running_job(bob, [device])
    Job.objects.filter(pk=job.pk).update(iterations=10)
    reported(job, range(3), at=30, every=10)
    ev = {"type": "iteration", "iteration": 3, "loss": 1.0, "iteration_s": 0.1, "throughput": 80.0}
    record_events(device, [{"seq": 1, "job": job.pk, "event": ev}])
    (frame,) = sent
    progress = [m for m in frame["messages"] if m["type"] == "progress"]
    assert progress and progress[0]["eta_s"] == pytest.approx(6 * 10, rel=0.05)  # 10 s apart, 6 left
