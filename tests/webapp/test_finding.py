"""Finding jobs: a name, tags and a note per job; the list's search, filters and order; jobs as CSV (issue 52)."""

import csv
import io

import pytest
from django.test import Client

from webapp.jobs.models import Job

pytestmark = pytest.mark.django_db


def job(owner, **fields) -> Job:
    return Job.objects.create(
        owner=owner, model=fields.pop("model", "mobilenetv2"), status=fields.pop("status", "completed"), **fields
    )


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def ids(page) -> list[int]:
    return [j.pk for j in page.context["jobs"]]


def test_a_job_is_named_tagged_and_noted_through_the_api_and_later_on_its_page(bob, carol, cluster_c):
    client = logged_in(bob)
    body = {"model": "mobilenetv2", "iterations": 2, "name": "baseline", "tags": ["lr-sweep", " a100 ", "LR-Sweep"],
            "note": "the first try"}  # fmt: skip
    doc = client.post("/api/jobs/", body, content_type="application/json").json()
    assert doc["name"] == "baseline" and doc["tags"] == ["lr-sweep", "a100"] and doc["note"] == "the first try"
    bad = client.post("/api/jobs/", {**body, "tags": "ok, <script>"}, content_type="application/json")
    assert bad.status_code == 400 and bad.json()["error"].startswith("tags: A tag is 1 to 40 letters")
    number = doc["id"]
    client.post(f"/jobs/{number}/label/", {"name": "renamed", "tags": "x, y", "note": "", "next": f"/jobs/{number}/"})
    job = Job.objects.get(pk=number)
    assert (job.name, job.tag_list, job.note) == ("renamed", ["x", "y"], "")
    assert "renamed" in client.get(f"/jobs/{number}/").content.decode()
    assert logged_in(carol).post(f"/jobs/{number}/label/", {"name": "mine"}).status_code == 404  # not hers
    assert Job.objects.get(pk=number).name == "renamed"


def test_the_list_searches_filters_and_sorts(bob, carol, alice):
    a = job(bob, name="alpha", tags="lr, baseline")
    b = job(bob, name="beta", tags="lr-sweep", model="gpt-small", status="failed")
    c = job(bob, name="gamma", note="try the alpha settings again")
    d = job(carol, name="delta", tags="lr")
    client = logged_in(bob)
    assert ids(client.get("/jobs/", {"q": "alpha"})) == [c.pk, a.pk]  # its name, the other's note
    assert ids(client.get("/jobs/", {"tag": "lr"})) == [a.pk]  # exactly the tag, not lr-sweep; not carol's
    assert ids(client.get("/jobs/", {"status": "failed"})) == [b.pk]
    assert ids(client.get("/jobs/", {"model": "gpt-small"})) == [b.pk]
    assert ids(client.get("/jobs/", {"sort": "name"})) == [a.pk, b.pk, c.pk]
    assert ids(client.get("/jobs/", {"q": str(b.pk)})) == [b.pk]
    assert ids(client.get("/jobs/", {"status": "nonsense", "sort": "nonsense"})) == [c.pk, b.pk, a.pk]
    assert ids(client.get("/jobs/", {"q": "x" * 5000})) == []  # cut short, no error
    staff = logged_in(alice)
    assert ids(staff.get("/jobs/", {"owner": "carol"})) == [d.pk]
    assert ids(client.get("/jobs/", {"owner": "carol"})) == [c.pk, b.pk, a.pk]  # only staff filter by owner
    for _ in range(50):
        job(bob, tags="lr")
    page = client.get("/jobs/", {"tag": "lr", "sort": "oldest"}).content.decode()
    assert 'href="?tag=lr&amp;sort=oldest&amp;page=2"' in page  # the next page keeps the query


def test_jobs_as_csv_from_the_list_and_from_the_compared(bob, carol):
    a = job(
        bob, name="alpha, with a comma", tags="lr", latest={"iteration": 4, "loss": 0.5, "measured_throughput": 12.5}
    )
    b = job(bob, name="beta")
    job(carol, name="hers")
    client = logged_in(bob)
    answer = client.get("/jobs/", {"format": "csv"})
    assert answer["Content-Type"].startswith("text/csv") and "attachment" in answer["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert [r["job"] for r in rows] == [str(b.pk), str(a.pk)]
    first = rows[1]
    assert first["name"] == "alpha, with a comma" and first["tags"] == "lr" and first["last_loss"] == "0.5"
    assert first["measured_samples_s"] == "12.5" and first["done_iterations"] == "5" and first["optimizer"] == "sgd"
    compared = client.get("/jobs/compare/", {"jobs": [a.pk, b.pk], "format": "csv"})
    assert [r["job"] for r in csv.DictReader(io.StringIO(compared.content.decode()))] == [str(a.pk), str(b.pk)]
    one = client.get("/jobs/compare/", {"jobs": [b.pk], "format": "csv"})  # any number ticked, for CSV
    assert [r["job"] for r in csv.DictReader(io.StringIO(one.content.decode()))] == [str(b.pk)]
    # free text that a spreadsheet would run as a formula is written as text
    Job.objects.filter(pk=b.pk).update(note='=HYPERLINK("http://evil")', name="@SUM(1+1)")
    row = next(csv.DictReader(io.StringIO(client.get("/jobs/", {"format": "csv", "q": "SUM"}).content.decode())))
    assert row["name"] == "'@SUM(1+1)" and row["note"] == '\'=HYPERLINK("http://evil")'
