"""The change tests. A new event kind is one dataclass in the catalogue (engine/events.py), and everything else
follows from it: the agent protocol accepts it, the site stores it, says its line in the job's log, relays it to
the job's browsers with its chart mark and puts it in the live page's snapshot, and the CLI prints its line.
A new run option is one `option(...)` field of RunOptions (engine/runtime/options.py), and the job form and its
API, the job's stored options, the devices' run options and the CLI's flag follow from it."""

from dataclasses import dataclass, make_dataclass

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator

from engine import events
from engine.eventbase import Event
from engine.runtime import options as run_options
from tests.webapp.test_sockets import HELLO, agent_socket, enrolled, running_job, say
from webapp.accounts.models import ApiToken
from webapp.asgi import application
from webapp.jobs.models import JobEvent

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass(frozen=True)
class Overheated(Event):
    """A made-up kind, as a developer would add one: a device reports its temperature crossed a limit."""

    TYPE = "overheated"
    SENT_BY, LOG = "device", "warning"
    NON_NEGATIVE = ("iteration",)

    device: str
    iteration: int
    celsius: float

    def line(self) -> str:
        return f"{self.device} overheated during iteration {self.iteration + 1}: {self.celsius:.0f} C"

    def mark(self) -> dict:
        return {"x": self.iteration + 1, "text": f"{self.device} hot", "tone": "warn"}


@pytest.fixture
def overheated(monkeypatch):
    monkeypatch.setitem(events.CATALOGUE, Overheated.TYPE, Overheated)  # what adding it to CATALOGUE does
    return {"type": "overheated", "device": "tx2-0", "iteration": 3, "celsius": 91.0}


def test_a_new_event_kind_is_accepted_stored_logged_relayed_and_marked(bob, overheated):
    device, credential = enrolled()
    job = running_job(bob, [device])
    line = "tx2-0 overheated during iteration 4: 91 C"
    unknown = {"type": "sparkles", "device": "tx2-0"}  # a kind the catalogue lacks (a newer agent's)

    async def run():
        _, token = await sync_to_async(ApiToken.issue)(bob)
        browser = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/",
                                        headers=[(b"authorization", f"Bearer {token}".encode())])  # fmt: skip
        assert (await browser.connect())[0]
        await browser.receive_json_from(5)  # the snapshot
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        await say(ws, HELLO)
        batch = [{"seq": 1, "job": job.pk, "event": unknown}, {"seq": 2, "job": job.pk, "event": overheated}]
        refused = await say(ws, {"type": "events", "events": batch})  # the unknown one: said, acknowledged
        assert refused["type"] == "error" and "unknown event type 'sparkles'" in refused["message"]
        assert await ws.receive_json_from(5) == {"type": "ack", "seq": 2}
        got = (await browser.receive_json_from(5))["messages"]
        await ws.disconnect()
        await browser.disconnect()
        return got

    got = async_to_sync(run)()
    mark = {"x": 4, "text": "tx2-0 hot", "tone": "warn"}
    assert [m for m in got if m["type"] == "log"][0]["message"] == line
    assert [m for m in got if m["type"] != "log"] == [{**overheated, "mark": mark}]
    assert list(JobEvent.objects.filter(job=job).exclude(type="log").values_list("type", flat=True)) == ["overheated"]

    from webapp.jobs.live import snapshot

    assert snapshot(job)["membership"] == [{**overheated, "mark": mark}]  # what a page opened later draws
    assert events.said(overheated) == line  # the CLI's line


# static/js/live.js in node over a stub page whose Plotly records what it draws: the marks come from the events'
# `mark`, whatever their kind (the page has no code for `overheated`).
MARKS_PAGE = r"""
const fs = require('fs');
const element = (id, dataset) => ({ id, dataset: dataset || {}, textContent: '', classList: new Set() });
const page = { live: element('live', { wsUrl: '/ws/jobs/1/', devices: '[]', predicted: '0', iterations: '8' }),
               'throughput-chart': element('throughput-chart') };
const sockets = [], timers = [], drawn = [];
global.window = { addEventListener() {}, Plotly: { react: (div, data, layout) => drawn.push(layout),
                                                   extendTraces: () => {} } };
global.Plotly = window.Plotly;
global.document = { readyState: 'complete', getElementById: (id) => page[id] || null, querySelectorAll: () => [],
                    querySelector: () => null };
global.location = { protocol: 'http:', host: '127.0.0.1:8000' };
global.setTimeout = (fn) => timers.push(fn);
global.clearTimeout = () => {};
global.fetch = () => new Promise(() => {});
global.WebSocket = class {
  constructor() { this.on = {}; sockets.push(this); }
  addEventListener(kind, fn) { this.on[kind] = fn; }
};
eval(fs.readFileSync(process.argv[2], 'utf8'));
const [lost, hot] = JSON.parse(process.argv[3]);
const it = (k) => ({ type: 'iteration', iteration: k, loss: 1.0, iteration_s: 0.1, throughput: 80.0 });
const send = (msg) => sockets[0].on.message({ data: JSON.stringify(msg) });
send({ type: 'snapshot', job: { status: 'running', iterations: 8 }, iterations: [0, 1, 2, 3].map(it), steps: [],
       devices: {}, log: [], membership: [lost] });
send({ type: 'batch', messages: [{ type: 'log', level: 'warning', message: 'hot' }, hot] });
timers.splice(0).forEach((fn) => fn());
const last = drawn[drawn.length - 1];
console.log(JSON.stringify(last.annotations.map((a) => [a.x, a.text])));
"""


def test_the_live_page_marks_any_kind_that_carries_a_mark(tmp_path, overheated):
    import json
    import shutil
    import subprocess
    from pathlib import Path

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    from webapp.jobs.notify import browser_event

    lost = browser_event(events.DeviceLost("nx-0", 2, "died (SIGKILL)", 0.4).to_message())
    hot = browser_event(overheated)
    harness = tmp_path / "marks_page.js"
    harness.write_text(MARKS_PAGE)
    live_js = Path(__file__).resolve().parents[2] / "static/js/live.js"
    out = subprocess.run([node, str(harness), str(live_js), json.dumps([lost, hot])], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[1.5, "nx-0 lost"], [4, "tx2-0 hot"]]


@pytest.fixture
def knob(monkeypatch):
    """RunOptions with one more option, declared as a developer would add it to engine/runtime/options.py."""
    field = ("knob", int, run_options.option(3, "Knob", "a made-up setting of the devices", 1, 9))
    extended = make_dataclass("RunOptions", [field], bases=(run_options.RunOptions,), frozen=True)
    monkeypatch.setattr(run_options, "RunOptions", extended)
    return extended


def test_a_new_run_option_is_a_form_field_a_stored_option_a_device_option_and_a_flag(
    knob, bob, cluster_c, profile_cache, django_capture_on_commit_callbacks, monkeypatch
):
    from django.test import Client

    from engine.cli.parser import build_parser
    from webapp.jobs import launching
    from webapp.jobs.models import Job

    told = []
    monkeypatch.setattr(launching, "tell_agent", lambda device_id, msg: told.append(msg))
    client = Client()
    client.force_login(bob)
    assert 'name="knob"' in client.get("/jobs/new/").content.decode()  # the form's field, with its label
    body = {"model": "mobilenetv2", "batch_size": 64, "iterations": 2}
    refused = client.post("/api/jobs/", {**body, "knob": 12}, content_type="application/json")
    assert refused.status_code == 400 and "knob: Must be a whole number from 1 to 9." in refused.json()["error"]
    with django_capture_on_commit_callbacks(execute=True):
        created = client.post("/api/jobs/", {**body, "knob": 5}, content_type="application/json")
    assert created.status_code == 201 and created.json()["knob"] == 5
    job = Job.objects.get(pk=created.json()["id"])
    assert job.options["knob"] == 5
    doc = client.post(f"/api/jobs/{job.pk}/launch/").json()
    assert doc["status"] == "running", doc["message"]
    assigned = [m for m in told if m["type"] == "assign"]
    assert assigned and all(knob.from_dict(m["options"]).knob == 5 for m in assigned)  # what the devices get
    args = build_parser().parse_args(["train", "--model", "mobilenetv2", "--cluster", "A", "--knob", "7"])
    assert args.knob == 7
