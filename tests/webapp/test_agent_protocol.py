"""The agent socket under hostile input: strict JSON, per-event checks, a stream that never jams, events stored
only when applied, spoofing and finished jobs, jobs reconciled with what agents say they run; and a fuzz test."""

import itertools
import json
import time

import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.webapp.test_sockets import HELLO, agent_socket, enrolled, running_job, say
from webapp.devices.models import Device
from webapp.jobs.models import Job, JobDevice, JobEvent

pytestmark = pytest.mark.django_db(transaction=True)

STEP = {"type": "step", "device": "tx2-0", "stage": 0, "micro_batch": 0, "kind": "F", "start": 0.0, "end": 0.1,
        "peer": "", "iteration": 0}  # fmt: skip
PROBE = "events: send 1 to 200 events per message, got 0"
DONE = {"type": "device-done", "device": "tx2-0", "late_steps": 0, "steps": 2, "part": False}


def batch(*events, first: int = 1, job: int = 0) -> dict:
    return {"type": "events", "events": [{"seq": first + k, "job": job, "event": ev} for k, ev in enumerate(events)]}


def talk(credential: str, *texts: str, session: str = "s1") -> list[dict]:
    """Say hello, send each text frame, and collect every reply (the socket must stay open throughout)."""

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        assert (await say(ws, {**HELLO, "session": session}))["type"] == "welcome"
        for text in texts:
            await ws.send_to(text_data=text)
        # A probe: the site answers messages in order, so every reply to the texts comes before the probe's.
        await ws.send_json_to({"type": "events", "events": []})
        replies = []
        while (reply := await ws.receive_json_from(20))["message" if "message" in reply else "type"] != PROBE:
            replies.append(reply)
        await ws.disconnect()
        return replies

    return async_to_sync(run)()


def test_a_diverged_loss_neither_jams_the_stream_nor_stops_the_job(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    nan = '{"type": "events", "events": [{"seq": 1, "job": JOB, "event": {"type": "iteration", "iteration": 0, '
    nan = (nan + '"loss": NaN, "iteration_s": 0.1, "throughput": 80.0}}]}').replace("JOB", str(job.pk))
    diverged = {"type": "iteration", "iteration": 0, "loss": None, "iteration_s": 0.1, "throughput": 80.0}
    garbled = {**diverged, "iteration": 1, "loss": "x"}
    replies = talk(credential, nan, json.dumps(batch(diverged, garbled, DONE, job=job.pk)))
    assert replies[0]["type"] == "error" and "NaN" in replies[0]["message"]  # the frame: not JSON the site takes
    assert (
        replies[1]["type"] == "error" and "event 2 dropped" in replies[1]["message"] and "loss" in replies[1]["message"]
    )
    assert replies[2] == {"type": "ack", "seq": 3}  # the bad event is acknowledged, never stored: nothing jams
    assert list(JobEvent.objects.filter(job=job).exclude(type="log").values_list("type", flat=True)) == [
        "iteration", "device-done"
    ]  # fmt: skip
    job.refresh_from_db()
    assert job.status == "completed" and job.latest["loss"] is None  # the device-done behind it was applied


@pytest.mark.parametrize(
    "text, word",
    [
        ('{"type": "heartbeat", "state": "idle", "job": ' + "9" * 5000 + "}", "digits"),
        ("[" * 50_000 + "]" * 50_000, "nested"),
        ('{"type": "events", "events": [{"seq": 1000000000000000000000000000000, "job": 1, "event": {}}]}', "digits"),
        ('{"type": "heartbeat", "state": "idle", "job": 1e400}', "finite"),
        ('{"type": "heartbeat", "state": "idle", "job": "one"}', "wrong type"),
        ('{"type": "heartbeat", "state": "idle", "job": Infinity}', "Infinity"),
    ],
)
def test_hostile_frames_get_an_error_reply_and_the_socket_stays_open(text, word):
    _, credential = enrolled()
    (reply,) = talk(credential, text)
    assert reply["type"] == "error" and word in reply["message"]


def test_bad_event_fields_are_dropped_one_by_one(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    huge_iteration = {"type": "iteration", "iteration": 0, "loss": 2.0, "iteration_s": -1.0, "throughput": 1.0}
    replies = talk(credential, json.dumps(batch(huge_iteration, {"type": "nope"}, STEP, job=job.pk)))
    assert [r["type"] for r in replies] == ["error", "error", "ack"] and replies[-1]["seq"] == 3
    assert JobEvent.objects.filter(job=job, type="step").count() == 1
    assert not JobEvent.objects.filter(job=job, type="iteration").exists()


def test_a_malformed_score_gets_one_error_line_and_is_not_stored(bob, client):
    device, credential = enrolled()
    job = running_job(bob, [device])
    score = {"type": "eval", "iteration": 0, "loss": 2.0, "accuracy": 0.5, "perplexity": None, "samples": 64,
             "device_s": 0.1}  # fmt: skip
    bad = [{**score, "accuracy": "x"}, {**score, "samples": -64}, {k: v for k, v in score.items() if k != "loss"}]
    replies = talk(credential, json.dumps(batch(*bad, job=job.pk)))
    assert replies == [
        {"type": "error", "message": "event 1 dropped: eval: field 'accuracy' has the wrong type (str; expected float "
                                     "or NoneType)"},
        {"type": "error", "message": "event 2 dropped: eval: field 'samples' must not be negative"},
        {"type": "error", "message": "event 3 dropped: eval: missing field 'loss'"},
        {"type": "ack", "seq": 3},
    ]  # fmt: skip
    assert not JobEvent.objects.filter(job=job, type="eval").exists()
    client.force_login(bob)
    assert client.get(f"/api/jobs/{job.pk}/").json()["eval"] == []


def test_an_iteration_after_the_job_ended_in_the_same_batch_leaves_its_progress(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    it = {"type": "iteration", "iteration": 0, "loss": 2.0, "iteration_s": 0.1, "throughput": 80.0}
    assert talk(credential, json.dumps(batch(it, job=job.pk))) == [{"type": "ack", "seq": 1}]
    job.refresh_from_db()
    assert job.progress == pytest.approx(1 / job.iterations) and job.latest["loss"] == 2.0
    late = {**it, "iteration": 1, "loss": 1.0}  # read with the job still running, applied after it completed
    talk(credential, json.dumps(batch(DONE, late, first=2, job=job.pk)), session="s1")
    job.refresh_from_db()
    assert job.status == "completed" and job.latest["loss"] == 2.0


def test_a_device_cannot_spoof_steps_nor_write_into_finished_jobs(bob, client):
    device, credential = enrolled()
    other, _ = enrolled("nx-0", "jetson-xavier-nx")
    job = running_job(bob, [device, other])
    spoof = {**STEP, "device": "nx-0", "evil": "<a href=x>"}
    talk(credential, json.dumps(batch(spoof, job=job.pk)))
    (stored,) = JobEvent.objects.filter(job=job, type="step").values_list("data", flat=True)
    assert stored["device"] == "tx2-0" and "evil" not in stored  # its own name; the catalogue's fields only
    Job.objects.filter(pk=job.pk).update(status="completed")
    talk(credential, json.dumps(batch({**STEP, "device": "ghost"}, first=2, job=job.pk)))
    assert JobEvent.objects.filter(job=job, type="step").count() == 1  # a finished job's record stays as it was
    client.force_login(bob)
    trace = client.get(f"/jobs/{job.pk}/trace.json")
    assert trace.status_code == 200 and len([e for e in trace.json()["traceEvents"] if e.get("ph") == "X"]) == 1
    upload = Client().post(f"/api/agent/jobs/{job.pk}/part/", b"x", content_type="application/octet-stream",
                           HTTP_AUTHORIZATION=f"Bearer {credential}")  # fmt: skip
    assert upload.status_code == 409 and "completed" in upload.json()["error"]


def test_an_agent_restarted_mid_job_is_logged_and_left_to_the_coordinator(bob):
    a, cred_a = enrolled()
    b, _ = enrolled("nx-0", "jetson-xavier-nx")
    job = running_job(bob, [a, b])
    JobDevice.objects.filter(job=job).update(state="training")
    talk(cred_a, session="s1")  # the agent that took the job, reconnecting
    talk(cred_a, session="s2")  # a new agent process: its device process died with the old one
    job.refresh_from_db()
    assert job.status == "running"  # the coordinator hears no more heartbeats from it and recovers (or fails)
    lines = [e["message"] for e in job.events.filter(type="log").values_list("data", flat=True)]
    assert lines == ["the agent of tx2-0 was restarted: its device process is gone"]  # once: s1 was the same agent


def test_an_idle_heartbeat_leaves_the_job_to_its_coordinator(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    JobDevice.objects.filter(job=job).update(state="training")
    beat = {"type": "heartbeat", "state": "idle", "job": None}
    replies = talk(credential, json.dumps({**beat, "pending": 3}), json.dumps({**beat, "pending": 0}))
    assert [r["type"] for r in replies] == []  # no cancel: only the job's coordinator ends a run
    job.refresh_from_db()
    assert job.status == "running"


# -- fuzz ------------------------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30), st.floats(), st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SESSIONS = itertools.count()
EVENT_KINDS = ["device-start", "step", "iteration", "eval", "device-done", "device-error", "job-stopped", "run-stop",
               "x"]  # fmt: skip
FIELDS = ["device", "stage", "micro_batch", "kind", "start", "end", "iteration", "loss", "iteration_s", "throughput",
          "late_steps", "steps", "message", "cause", "reason", "rank", "dilation", "part", "accuracy",
          "samples"]  # fmt: skip
VALID = [STEP, DONE, {"type": "iteration", "iteration": 0, "loss": 2.0, "iteration_s": 0.1, "throughput": 80.0},
         {"type": "eval", "iteration": 0, "loss": 2.0, "accuracy": 0.5, "perplexity": None, "samples": 64,
          "device_s": 0.1},
         {"type": "device-start", "device": "tx2-0", "rank": 0, "stage": 0, "dilation": 10.0, "pid": 1},
         {"type": "device-error", "device": "tx2-0", "iteration": 1, "message": "x", "cause": "peer"},
         {"type": "job-stopped", "device": "tx2-0", "reason": "cancelled"}]  # fmt: skip
events = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(EVENT_KINDS)}, optional={f: values for f in FIELDS}),
    st.sampled_from(VALID),  # real events, so that storing and applying are exercised too
    st.builds(lambda ev, k, v: {**ev, k: v}, st.sampled_from(VALID), st.sampled_from(FIELDS), values),  # one field off
)
items = st.fixed_dictionaries({"seq": st.integers(-2, 10**20), "job": st.integers(-1, 10**20), "event": events})
messages = st.one_of(
    st.fixed_dictionaries({"type": st.just("events"), "events": st.lists(items, max_size=5)}),
    st.fixed_dictionaries({"type": st.sampled_from(["heartbeat", "accepted", "hello", "x"])},
                          optional={k: values for k in ("state", "job", "port", "session", "pending", "kind")}),
    values,
)  # fmt: skip


def _frame(msg, job_id: int) -> str:
    if isinstance(msg, dict) and msg.get("type") == "events":  # point most events at the fuzzed device's job
        renumber = bool(msg["events"]) and msg["events"][0]["seq"] % 4 != 0  # mostly well-ordered seqs
        for k, it in enumerate(msg["events"], 1):
            if it["job"] >= 0 and it["job"] % 3:
                it["job"] = job_id
            if renumber:
                it["seq"] = k
    return json.dumps(msg)  # NaN and Infinity included: Python writes them


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=st.lists(messages, min_size=1, max_size=4))
def test_fuzzed_agent_messages_are_answered_and_never_store_what_is_not_applied(bob, alice, msgs):
    n = next(SESSIONS)  # a fresh device, job and bystander job per example
    device, credential = enrolled(f"tx2-{n}")
    other, _ = enrolled(f"nx-{n}", "jetson-xavier-nx")
    job, bystander = running_job(bob, [device]), running_job(alice, [other])
    replies = talk(credential, *[_frame(m, job.pk) for m in msgs])
    assert all(isinstance(r, dict) and "type" in r for r in replies)
    for ev in JobEvent.objects.filter(job=job).exclude(type="log"):
        assert ev.device == device.name and ev.data.get("device", device.name) == device.name
    kinds = set(JobEvent.objects.filter(job=job).values_list("type", flat=True))
    job.refresh_from_db()
    own_error = JobEvent.objects.filter(job=job, type="device-error", data__cause="own").exists()
    if "device-done" in kinds or own_error:  # stored means applied: its only device ended, so did the job
        assert job.finished
    if "iteration" in kinds and job.status == "running":
        assert job.latest.get("type") == "iteration"
    bystander.refresh_from_db()
    assert bystander.status == "running" and not JobEvent.objects.filter(job=bystander).exclude(type="log").exists()


def test_an_agent_over_its_event_rate_is_slowed_down_not_dropped():
    from webapp.lib.pace import Pace

    pace = Pace(rate=100, burst=200)
    assert pace.delay(150) == 0 and pace.delay(50) == 0  # the burst
    assert pace.delay(100) == pytest.approx(1.0, abs=0.05)  # 100 past the budget: a second's worth at 100/s


def test_a_type_that_is_not_a_string_is_an_error_reply(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    JobDevice.objects.filter(job=job).update(state="training")
    odd = [{"type": [1]}, {"type": {"a": 1}}, batch({"type": [1]}, job=job.pk), {"type": "heartbeat", "state": "busy",
           "pending": 0}]  # fmt: skip
    replies = talk(credential, *map(json.dumps, odd))
    assert [r["type"] for r in replies] == ["error", "error", "error", "ack"]
    job.refresh_from_db()
    assert job.status == "running"  # what an agent runs is its job coordinator's business, not the heartbeat's


def _probe(scale: float = 1.0) -> dict:
    from engine.predictor.probe import PROBE_KEYS

    return {k: [1e-4 * scale * (i + 1), 2e-4 * scale * (i + 1)] for i, k in enumerate(PROBE_KEYS)}


def test_a_board_of_no_known_kind_enrolls_with_its_probe_and_is_planned_from_it(bob, profile_cache):
    from dataclasses import replace

    from engine.devices import Cluster
    from engine.workloads import workload

    device = Device.objects.create(name="orin-0", kind="custom", memory_gb=8, gflops=500)
    device, credential = Device.enroll(device.issue_enrollment())

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        hello = {**HELLO, "kind": "custom", "emulated": False, "probe": _probe()}
        assert (await say(ws, hello))["type"] == "welcome"
        await ws.disconnect()

    async_to_sync(run)()
    device.refresh_from_db()
    engine_device = device.to_engine()
    assert json.loads(engine_device.probe) == _probe()

    w = workload("mobilenetv2", cluster=Cluster((engine_device,)))
    fwd, bwd = w.device_times["orin-0"]
    assert len(fwd) == w.num_layers and all(t > 0 for t in (*fwd, *bwd))
    slower_device = replace(engine_device, probe=json.dumps(_probe(3.0), sort_keys=True))
    slower = workload("mobilenetv2", cluster=Cluster((slower_device,)))
    assert sum(slower.device_times["orin-0"][0]) > 2 * sum(fwd)  # a 3x slower probe: much slower predictions


@pytest.mark.parametrize(
    "probe, needle",
    [("fast", "probe must be an object"), ({}, "probe lacks layers"), ({"x": [1, 2]}, "probe lacks layers")],
)
def test_a_malformed_probe_in_hello_is_refused(probe, needle):
    device, credential = enrolled()

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        reply = await say(ws, {**HELLO, "probe": probe})
        await ws.disconnect()
        return reply

    reply = async_to_sync(run)()
    assert reply["type"] == "error" and needle in reply["message"]
    device.refresh_from_db()
    assert "probe" not in device.measured


def test_clock_probes_are_answered_at_once_and_malformed_ones_get_one_error_line():
    _, credential = enrolled()
    sent = time.monotonic()
    bad = [json.dumps({"type": "clock", **t0}) for t0 in ({}, {"t0": "1.5"}, {"t0": True}, {"t0": None})]
    good = [json.dumps({"type": "clock", "t0": sent}), json.dumps({"type": "clock", "t0": 7})]
    replies = talk(credential, *bad, '{"type": "clock", "t0": NaN}', *good)
    assert replies[:5] == [
        {"type": "error", "message": "clock: missing field 't0'"},
        {"type": "error", "message": "clock: field 't0' has the wrong type (str)"},
        {"type": "error", "message": "clock: field 't0' has the wrong type (bool)"},
        {"type": "error", "message": "clock: missing field 't0'"},
        {"type": "error", "message": "NaN is not a JSON number; send finite numbers (or null)"},
    ]
    answer, other = replies[5:]
    assert answer["type"] == "clock" and answer["t0"] == sent <= answer["t1"] <= answer["t2"] <= time.monotonic()
    assert other["t0"] == 7 and set(other) == {"type", "t0", "t1", "t2"}  # echoed as sent; the socket stayed open


def test_a_clock_probe_before_hello_is_refused_like_any_message():
    _, credential = enrolled()

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        assert await say(ws, {"type": "clock", "t0": 1.0}) == {"type": "error", "message": "say hello first"}
        assert (await say(ws, HELLO))["type"] == "welcome"
        assert (await say(ws, {"type": "clock", "t0": 1.0}))["type"] == "clock"
        await ws.disconnect()

    async_to_sync(run)()


def test_an_agent_is_let_in_and_heard_while_the_database_thread_is_busy():
    """Authentication does not queue behind the one thread where sockets' database work runs (stored event
    batches, hellos): an agent connects and its heartbeat is noted alive while that thread is held."""
    import asyncio

    from channels.db import database_sync_to_async

    from webapp.devices import liveness

    device, credential = enrolled()

    async def run():
        busy = asyncio.ensure_future(database_sync_to_async(time.sleep)(5))  # the database thread, held
        await asyncio.sleep(0.2)
        ws = agent_socket(credential)
        assert (await ws.connect(timeout=4))[0]
        await ws.send_json_to(HELLO)
        await ws.send_json_to({"type": "heartbeat", "state": "idle", "job": None, "pending": 0})
        for _ in range(40):
            heard = await database_sync_to_async(liveness.last_heard, thread_sensitive=False)([device.pk])
            if heard or busy.done():
                break
            await asyncio.sleep(0.1)
        assert heard and not busy.done()  # heard before the database thread was free again
        assert (await ws.receive_json_from(10))["type"] == "welcome"  # the hello is answered once it is
        await busy
        await ws.disconnect()

    async_to_sync(run)()


def test_the_sites_messages_to_an_agent_wait_for_its_welcome():
    """A coordinator's message to a board that has just connected and not yet been welcomed (its hello waits
    for the database) is held, then sent after the welcome: an agent skips anything before its welcome."""
    from channels.layers import get_channel_layer

    from webapp.devices.agents import agent_group

    device, credential = enrolled()
    start = {"type": "start", "job": 7, "generation": 0}

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        await get_channel_layer().group_send(agent_group(device.pk), {"type": "agent.message", "message": start})
        await ws.send_json_to(HELLO)
        assert (await ws.receive_json_from(5))["type"] == "welcome"
        assert await ws.receive_json_from(5) == start
        await ws.disconnect()

    async_to_sync(run)()
