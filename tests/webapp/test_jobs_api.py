"""The jobs API: create (planned by the task), read, launch, cancel; who may see what; auth and bad input."""

import pytest
from django.test import Client

from webapp.accounts.models import ApiToken
from webapp.jobs.models import Job, JobDevice


@pytest.fixture
def planned(bob, cluster_c, profile_cache, django_capture_on_commit_callbacks):
    """bob's mobilenetv2 job on cluster C, created through the API and planned by the (eager) task."""
    client = Client()
    client.force_login(bob)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            "/api/jobs/",
            {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 64, "iterations": 3},
            content_type="application/json",
        )
    assert response.status_code == 201, response.content
    return Job.objects.get(pk=response.json()["id"])


def test_create_plans_the_job_with_every_method(planned):
    assert planned.status == "planned", planned.message
    assert planned.plan["method"] == "asteroid" and planned.plan["batch_size"] == 64
    assert set(planned.comparison) == {"asteroid", "dp", "gpipe", "pipedream", "ftpipehd"}
    # The planner may leave slow devices out; those it uses are cluster C's.
    assert set(planned.device_names) <= {"nx-0", "tx2-0", "tx2-1", "nano-0", "nano-1", "nano-2"}
    assert "nx-0" in planned.device_names and planned.plan["predicted"]["fits"]
    assert planned.simulation and {s["kind"] for s in planned.simulation} >= {"F", "B"}
    best = planned.plan["predicted"]["throughput"]
    others = [p["predicted"]["throughput"] for m, p in planned.comparison.items() if "error" not in p]
    assert best >= max(others) * 0.999  # the plan shown is the best the cost model knows


def test_get_returns_status_plan_and_latest(planned, bob):
    client = Client()
    client.force_login(bob)
    doc = client.get(f"/api/jobs/{planned.pk}/").json()
    assert doc["status"] == "planned" and doc["plan"]["stages"] and doc["latest"] == {}
    assert doc["comparison"]["asteroid"]["throughput"] == pytest.approx(planned.predicted_throughput)


def test_another_user_gets_404_and_staff_sees_all(planned, carol, alice):
    client = Client()
    client.force_login(carol)
    assert client.get(f"/api/jobs/{planned.pk}/").status_code == 404
    assert client.post(f"/api/jobs/{planned.pk}/launch/").status_code == 404
    assert client.post(f"/api/jobs/{planned.pk}/cancel/").status_code == 404
    assert client.get("/api/jobs/").json()["jobs"] == []
    assert client.get(f"/jobs/{planned.pk}/").status_code == 404
    assert client.get(f"/jobs/{planned.pk}/live/").status_code == 404
    client.force_login(alice)
    assert client.get(f"/api/jobs/{planned.pk}/").status_code == 200
    assert [j["id"] for j in client.get("/api/jobs/").json()["jobs"]] == [planned.pk]


def test_bearer_token_and_no_auth(planned, bob):
    _, token = ApiToken.issue(bob)
    client = Client()
    assert client.get("/api/jobs/").status_code == 401
    assert "Bearer" in client.get("/api/jobs/").json()["error"]
    ok = client.get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert ok.status_code == 200 and [j["id"] for j in ok.json()["jobs"]] == [planned.pk]
    bad = client.get("/api/jobs/", HTTP_AUTHORIZATION="Bearer ast_api_nope")
    assert bad.status_code == 401 and "invalid or revoked" in bad.json()["error"]


def test_session_writes_need_csrf_but_tokens_do_not(bob, cluster_c):
    client = Client(enforce_csrf_checks=True)
    client.force_login(bob)
    body = {"model": "mobilenetv2", "batch_size": 64, "iterations": 2}
    refused = client.post("/api/jobs/", body, content_type="application/json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
    _, token = ApiToken.issue(bob)
    accepted = Client(enforce_csrf_checks=True).post(
        "/api/jobs/", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert accepted.status_code == 201


@pytest.mark.parametrize(
    "body, message",
    [
        ({"model": "alexnet", "batch_size": 64, "iterations": 2}, "model: Select a valid choice"),
        ({"model": "mobilenetv2", "batch_size": 0, "iterations": 2}, "batch_size: Ensure this value is greater"),
        ({"model": "mobilenetv2", "batch_size": 64}, "iterations: Give the number of iterations or of epochs"),
        ({"model": "bert-small", "dataset": "cifar10", "batch_size": 8, "iterations": 2}, "dataset: cifar10 needs"),
        ({"model": "mobilenetv2", "batch_size": 64, "iterations": 2, "devices": ["nx-9"]}, "devices: Select a valid"),
    ],
)
def test_bad_requests_get_one_line(bob, cluster_c, body, message):
    client = Client()
    client.force_login(bob)
    response = client.post("/api/jobs/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"].startswith(message), response.json()
    assert Job.objects.count() == 0


def test_not_json_and_no_devices(bob):
    client = Client()
    client.force_login(bob)
    response = client.post("/api/jobs/", "{oops", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"] == "the request body is not valid JSON"
    response = client.post("/api/jobs/", {"model": "mobilenetv2", "batch_size": 8, "iterations": 1},
                           content_type="application/json")  # fmt: skip
    assert response.status_code == 400 and "No device is online and idle" in response.json()["error"]


def test_a_job_that_does_not_fit_fails_with_the_reason(bob, profile_cache, django_capture_on_commit_callbacks):
    from webapp.devices.models import Device

    Device.objects.create(name="tiny", kind="custom", memory_gb=0.03, gflops=100, status="online")
    client = Client()
    client.force_login(bob)
    body = {"model": "mobilenetv2", "batch_size": 64, "iterations": 1, "devices": ["tiny"]}
    with django_capture_on_commit_callbacks(execute=True):
        job_id = client.post("/api/jobs/", body, content_type="application/json").json()["id"]
    doc = client.get(f"/api/jobs/{job_id}/").json()
    assert doc["status"] == "failed"
    assert "does not fit in cluster" in doc["message"] and "GiB usable in all" in doc["message"], doc["message"]


def test_launch_assigns_every_device_and_cancel_frees_them(planned, bob):
    client = Client()
    client.force_login(bob)
    doc = client.post(f"/api/jobs/{planned.pk}/launch/").json()
    assert doc["status"] == "running"
    rows = list(JobDevice.objects.filter(job=planned))
    assert [r.name for r in rows] == planned.device_names and [r.rank for r in rows] == list(range(len(rows)))
    assert {r.device.status for r in rows} == {"busy"}
    again = client.post(f"/api/jobs/{planned.pk}/launch/")
    assert again.status_code == 409 and "not planned" in again.json()["error"]
    assert client.post(f"/api/jobs/{planned.pk}/cancel/").json()["status"] == "cancelled"
    assert {r.device.status for r in JobDevice.objects.filter(job=planned).select_related("device")} == {"online"}
    assert client.post(f"/api/jobs/{planned.pk}/cancel/").status_code == 409


def test_launch_refuses_an_offline_device(planned, bob):
    from webapp.devices.models import Device

    Device.objects.filter(name=planned.device_names[-1]).update(status="offline")
    client = Client()
    client.force_login(bob)
    response = client.post(f"/api/jobs/{planned.pk}/launch/")
    assert response.status_code == 409 and "is offline" in response.json()["error"]
    planned.refresh_from_db()
    assert planned.status == "planned"
