"""Job pages: the form (with errors on it), the plan page with its figures and tables, live page, downloads."""

import json

import pytest
from django.utils import timezone

from tests.webapp.livepage import run_live_js
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


def test_a_frozen_job_is_planned_for_its_recipe_and_its_pages_say_so(
    client, bob, cluster_c, profile_cache, django_capture_on_commit_callbacks
):
    client.force_login(bob)
    body = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 64, "iterations": 5, "bandwidth_mbps": 1000}
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/jobs/new/", body)
        client.post("/jobs/new/", {**body, "optimizer": "adamw", "lr": 0.001, "freeze": r"^([0-9]|1[0-5])\."})
    full, frozen = Job.objects.order_by("pk")
    assert frozen.options["freeze"] and frozen.status == full.status == "planned", frozen.message
    page = client.get(f"/jobs/{frozen.pk}/").content.decode()
    assert "Recipe: adamw, lr 0.001, frozen: the weights" in page and "The plan is made for it" in page
    assert "Recipe: sgd (momentum 0.9), lr 0.05." in client.get(f"/jobs/{full.pk}/").content.decode()


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
    assert "No device is online" in page


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
    assert '<span id="model-link" hidden>' in live and 'data-devices="[&quot;nx-0&quot;]"' in live  # none yet
    trace = client.get(f"/jobs/{job.pk}/trace.json").json()
    assert [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"] == ["F0"]
    missing = client.get(f"/jobs/{job.pk}/model.pt", follow=True)  # nothing was uploaded: said on the page
    assert missing.redirect_chain[-1][0] == f"/jobs/{job.pk}/live/"
    assert f"Job {job.pk} has no trained model: it completed before every device" in missing.content.decode()
    folder = settings.ASTEROID_JOBS_DIR / str(job.pk)
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    live = client.get(f"/jobs/{job.pk}/live/").content.decode()
    assert '<span id="model-link">' in live and 'id="download-model"' in live
    download = client.get(f"/jobs/{job.pk}/model.pt")
    assert b"".join(download.streaming_content) == b"weights"
    assert "attachment" in download["Content-Disposition"]
    assert download["Content-Type"] == "application/octet-stream"  # not what mimetypes guesses for .pt


def test_the_live_page_has_a_held_out_chart_only_for_an_evaluated_job(client, bob):
    client.force_login(bob)
    plain = Job.objects.create(owner=bob, model="mobilenetv2", status="running")
    scored = Job.objects.create(owner=bob, model="mobilenetv2", status="running", options={"eval_every": 5})
    assert 'id="eval-chart"' not in client.get(f"/jobs/{plain.pk}/live/").content.decode()
    page = client.get(f"/jobs/{scored.pk}/live/").content.decode()
    assert 'id="eval-chart"' in page and "every 5 iterations" in page


# static/js/live.js in node over a stub page: a Plotly that records what it draws, a socket the test drives.
EVAL_PAGE = r"""
const element = (id, dataset) => ({ id, dataset: dataset || {}, textContent: '', classList: new Set() });
const page = { live: element('live', { wsUrl: '/ws/jobs/1/', devices: '[]', predicted: '0', iterations: '4' }),
               'loss-chart': element('loss-chart'), 'eval-chart': element('eval-chart') };
const calls = [];
global.window = { addEventListener() {}, Plotly: {
  react: (div, data, layout) => { div.data = data; calls.push({ how: 'react', div: div.id, data, layout }); },
  extendTraces: (div, update, traces) => calls.push({ how: 'extend', div: div.id, update, traces }),
} };
"""
EVAL_SCRIPT = r"""
const [first, later] = JSON.parse(process.argv[3]);
const iteration = { type: 'iteration', iteration: 0, loss: 2.0, iteration_s: 0.1, throughput: 80.0 };
const job = { status: 'running', iterations: 4, eval: [first] };
send({ type: 'snapshot', job, iterations: [iteration], steps: [], devices: {}, log: [] });
const loaded = calls.length;
send({ type: 'batch', messages: [{ type: 'eval', ...later }] });
timers.splice(0).forEach((fn) => fn());
console.log(JSON.stringify({ loaded: calls.slice(0, loaded), live: calls.slice(loaded) }));
"""

SCORE = {"iteration": 1, "loss": 1.2, "accuracy": 0.5, "perplexity": None, "samples": 256, "device_s": 0.1}


@pytest.mark.parametrize(
    "first, later, axis, shown",
    [
        (SCORE, {**SCORE, "iteration": 3, "loss": 0.9, "accuracy": 0.75}, "held-out accuracy (%)", [50.0, 75.0]),
        ({**SCORE, "accuracy": None, "perplexity": 3.3}, {**SCORE, "iteration": 3, "loss": 0.9, "accuracy": None,
                                                          "perplexity": 2.5}, "held-out perplexity", [3.3, 2.5]),
    ],
)  # fmt: skip
def test_the_live_page_draws_held_out_scores_then_appends_new_ones(tmp_path, first, later, axis, shown):
    calls = run_live_js(tmp_path, EVAL_PAGE, EVAL_SCRIPT, json.dumps([first, later]))
    loss, scores = [[c for c in calls["loaded"] if c["div"] == div][-1] for div in ("loss-chart", "eval-chart")]
    assert [t["name"] for t in loss["data"]] == ["training", "held-out"]
    assert loss["data"][1]["x"] == [2] and loss["data"][1]["y"] == [1.2]  # after iteration 1 (0-based): x = 2
    assert scores["data"][0]["x"] == [2] and scores["data"][0]["y"] == [shown[0]]
    assert scores["layout"]["yaxis"]["title"]["text"] == axis
    assert calls["live"] == [  # the new score is appended to both charts, nothing redrawn
        {"how": "extend", "div": "loss-chart", "update": {"x": [[4]], "y": [[0.9]]}, "traces": [1]},
        {"how": "extend", "div": "eval-chart", "update": {"x": [[4]], "y": [[shown[1]]], "customdata": [[256]]},
         "traces": [0]},
    ]  # fmt: skip


PROGRESS_PAGE = r"""
const element = (id, dataset) => ({ id, dataset: dataset || {}, textContent: '', classList: new Set() });
const page = { live: element('live', { wsUrl: '/ws/jobs/1/', devices: '[]', predicted: '0', iterations: '40' }),
               'job-progress': element('job-progress'), 'job-progress-bar': element('job-progress-bar'),
               'job-eta': element('job-eta') };
global.window = { addEventListener() {} };
"""
PROGRESS_SCRIPT = r"""
const it = (k) => ({ type: 'iteration', iteration: k, loss: 1.0, iteration_s: 0.1, throughput: 80.0 });
const shown = [];
send({ type: 'snapshot', job: { status: 'running', iterations: 40 }, iterations: [...Array(19).keys()].map(it),
       steps: [], devices: {}, log: [] });
shown.push([page['job-progress'].textContent, page['job-progress-bar'].value]);
send(it(0));  // the site restarted: the run replays from its central replica at iteration 0
send(it(5));
shown.push([page['job-progress'].textContent, page['job-progress-bar'].value]);
send(it(18));
send(it(19));  // past where it was: new ground
timers.splice(0).forEach((fn) => fn());  // the charts' flush
shown.push([page['job-progress'].textContent, page['job-progress-bar'].value]);
console.log(JSON.stringify(shown));
"""


def test_the_live_page_says_a_resumed_run_is_replaying_and_where(tmp_path):
    assert run_live_js(tmp_path, PROGRESS_PAGE, PROGRESS_SCRIPT) == [
        ["19 / 40", 19],
        ["19 / 40 · replaying 6 of 19", 19],
        ["20 / 40", 20],
    ]


def test_the_live_page_measures_each_device_against_its_planned_compute(
    client, bob, carol, cluster_c, profile_cache, django_capture_on_commit_callbacks
):
    client.force_login(bob)
    body = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 64, "iterations": 5, "lr": 0.05,
            "bandwidth_mbps": 1000}  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/jobs/new/", body)
    job = Job.objects.get()
    planned = client.get(f"/jobs/{job.pk}/planned.json").json()["planned_s"]
    assert set(planned) == set(job.device_names) and all(s > 0 for s in planned.values())
    assert 'class="speed num"' in client.get(f"/jobs/{job.pk}/live/").content.decode()
    client.force_login(carol)
    assert client.get(f"/jobs/{job.pk}/planned.json").status_code == 404
