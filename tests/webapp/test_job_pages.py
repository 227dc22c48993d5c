"""Job pages: the form (with errors on it), the plan page with its figures and tables, live page, downloads."""

import json

from django.utils import timezone

from webapp.jobs.models import Job, JobDevice, JobEvent


def test_form_plans_and_shows_the_plan(client, bob, cluster_c, profile_cache, django_capture_on_commit_callbacks):
    client.force_login(bob)
    form = client.get("/jobs/new/").content.decode()
    assert 'value="mobilenetv2"' in form and 'name="devices"' in form
    body = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 64, "iterations": 5, "lr": 0.05,
            "bandwidth_mbps": 1000}  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/jobs/new/", body)
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "Launch on" in page and 'id="comparison"' in page and 'id="plan-devices"' in page
    for fig in ("fig-comparison", "fig-pipeline", "fig-memory", "fig-timeline"):
        assert f'data-figure-id="{fig}"' in page
        doc = json.loads(page.split(f'<script id="{fig}" type="application/json">')[1].split("</script>")[0])
        assert doc["data"], fig
    assert "/static/vendor/plotly/plotly.min.js" in page and "cdn" not in page.lower()


def test_form_errors_are_on_the_form(client, bob, cluster_c):
    client.force_login(bob)
    page = client.post("/jobs/new/", {"model": "bert-small", "dataset": "cifar10", "batch_size": 8, "lr": 0.05,
                                      "bandwidth_mbps": 1000, "iterations": 2}).content.decode()  # fmt: skip
    assert "cifar10 needs a 32x32 image model with 10 classes" in page and Job.objects.count() == 0


def test_absurd_epochs_is_a_form_error_with_the_range(client, bob, cluster_c):
    # epochs=1e306 made round(inf) raise OverflowError: a 500 instead of a message on the form.
    client.force_login(bob)
    body = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 8, "lr": 0.05, "bandwidth_mbps": 1000}
    for epochs in ("1e306", "1e999", "inf"):
        page = client.post("/jobs/new/", {**body, "epochs": epochs})
        assert page.status_code == 200 and "Must be a number from 0.01 to 1000." in page.content.decode(), epochs
    assert Job.objects.count() == 0


def test_no_online_device_is_a_form_error(client, bob):
    client.force_login(bob)
    page = client.post("/jobs/new/", {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 8, "lr": 0.05,
                                      "bandwidth_mbps": 1000, "iterations": 2}).content.decode()  # fmt: skip
    assert "No device is online and idle" in page


def test_finished_job_offers_model_and_trace(client, bob, settings):
    now = timezone.now()
    plan = {"method": "asteroid", "model": "mobilenetv2", "batch_size": 8, "micro_batches": 1,
            "stages": [{"layers": [0, 3], "devices": [{"name": "nx-0", "samples": 8}]}],
            "cluster": {"devices": [{"name": "nx-0", "kind": "nx"}]},
            "predicted": {"throughput": 10.0, "iteration_s": 0.8, "bubble_fraction": 0.0, "memory_bytes": {},
                          "fits": True}}  # fmt: skip
    job = Job.objects.create(owner=bob, model="mobilenetv2", plan=plan, status="completed", launched_at=now,
                             finished_at=now)  # fmt: skip
    JobDevice.objects.create(job=job, name="nx-0", rank=0, state="done")
    step = {"type": "step", "device": "nx-0", "stage": 0, "micro_batch": 0, "kind": "F", "start": 0.0, "end": 0.5,
            "peer": "", "iteration": 0}  # fmt: skip
    JobEvent.objects.create(job=job, device="nx-0", type="step", data=step)
    client.force_login(bob)
    live = client.get(f"/jobs/{job.pk}/live/").content.decode()
    assert 'id="download-model"' in live and 'data-devices="[&quot;nx-0&quot;]"' in live
    trace = client.get(f"/jobs/{job.pk}/trace.json").json()
    assert [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"] == ["F0"]
    assert client.get(f"/jobs/{job.pk}/model.pt").status_code == 404  # nothing was uploaded
    folder = settings.ASTEROID_JOBS_DIR / str(job.pk)
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    download = client.get(f"/jobs/{job.pk}/model.pt")
    assert b"".join(download.streaming_content) == b"weights"
    assert "attachment" in download["Content-Disposition"]
