"""Agents against a fake site speaking docs/protocol.md, running real (small, emulated) device processes.

Covers: hello/welcome, events with seqs and acks, a dropped connection (backoff, resend of what was not
stored with the same seqs), heartbeats while a device trains, rank 0's rendezvous port, the model part
upload, cancel, a device process that dies, a refused assignment, a refused credential, a site that is
down when the agent starts, and an agent stopped mid-run.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from engine.devices import KINDS, Cluster, Device, get_kind
from engine.models import get_model
from tests.engine.runtime.helpers import cluster_of, make_plan, sized_workload
from tests.workers.fakesite import FakeSite
from workers.agent import Agent
from workers.connection import Backoff, Refused, event_messages
from workers.device import KILL_AFTER_S, free_port
from workers.probe import Capacity
from workers.site import Site

MODEL = "mobilenetv2"
# Runs whose device time is set by a made-up workload: ~0.05 device s per iteration of two devices, so a
# dilation of 10 makes an iteration last about half a second of wall time on this host.
OPTIONS = {
    "iterations": 3,
    "lr": 0.05,
    "seed": 0,
    "dataset": "synthetic",
    "emulate": True,
    "dilation": 10.0,
    "timeout_s": 20.0,
    "save_model": False,
    "generation": 0,
}
START_S = 60  # the first device process also starts the fork server (torch imported once)
DEVICES = {"nx-0": "cred-nx", "nano-1": "cred-nano", "tx2-2": "cred-tx2"}
jobs = itertools.count(11)


def workload(model: str):
    return sized_workload(model, 1e9)


def capacity(name: str) -> Capacity:
    """What an agent emulating the kind in the device's name reports (given, to skip the benchmark)."""
    kind = get_kind(name.split("-")[0])
    return Capacity(kind.key, True, int(kind.memory_gb * 2**30), kind.gflops, 30.0)


@contextmanager
def running(agent: Agent):
    """The agent served on a thread of its own, as a launcher or a live-server test would run it."""
    thread = threading.Thread(target=agent.run, name="agent", daemon=True)
    thread.start()
    try:
        assert agent.connected.wait(30), "the agent never got a welcome"
        yield agent
    finally:
        agent.stop()
        thread.join(15)
        assert not thread.is_alive(), "the agent did not stop"


def make_agent(site: FakeSite | Site, name: str) -> Agent:
    where = site.site if isinstance(site, FakeSite) else site
    return Agent(where, DEVICES[name], workload=workload, capacity=capacity(name))


@pytest.fixture(scope="module")
def site():
    with FakeSite(DEVICES) as fake:
        fake.revoked.add("cred-revoked")
        yield fake


@pytest.fixture(scope="module")
def agents(site):
    with running(make_agent(site, "nx-0")) as a, running(make_agent(site, "nano-1")) as b:
        yield {"nx-0": a, "nano-1": b}


def solo_plan(name: str):
    """A one-device plan for the device called `name`."""
    cluster = Cluster((Device.of_kind(name, name.split("-")[0]),), name="test")
    return make_plan(MODEL, cluster, 8, 2, [(0, 21, [(name, 4)])])


def assign(site: FakeSite, job: int, plan, name: str, **options) -> None:
    msg = {"type": "assign", "job": job, "plan": plan.to_dict(), "rank": plan.device_names.index(name)}
    site.send(name, {**msg, "options": {**OPTIONS, **options}})


def accepted(site: FakeSite, name: str, job: int) -> dict:
    found = [m for _, m in site.messages(name, "accepted") if m["job"] == job]
    return found[-1] if found else None


def start_solo(site: FakeSite, name: str, **options) -> tuple[int, int]:
    """Assign and start a one-device job; (job, pid of its device process) once it trains."""
    job = next(jobs)
    assign(site, job, solo_plan(name), name, **options)
    port = site.wait(lambda: accepted(site, name, job), 30, f"{name} accepting job {job}")["port"]
    site.send(name, {"type": "start", "job": job, "host": "127.0.0.1", "port": port})
    started = site.wait(lambda: site.events(name, "device-start", job), START_S, f"{name} starting job {job}")
    return job, started[0]["pid"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def heartbeats_between(site: FakeSite, name: str, t0: float, t1: float) -> list[tuple[float, dict]]:
    return [(t, m) for t, m in site.messages(name, "heartbeat") if t0 <= t <= t1]


def received_at(site: FakeSite, name: str, kind: str, job: int) -> float:
    """When the site received the events message holding `name`'s first `kind` event of `job`."""
    for t, m in site.messages(name, "events"):
        if any(e["job"] == job and e["event"]["type"] == kind for e in m["events"]):
            return t
    raise AssertionError(f"no {kind} event of job {job} from {name}")


# -- pure parts ---------------------------------------------------------------------------------------


def test_backoff_doubles_to_thirty_seconds_with_jitter_and_resets():
    top = Backoff(rng=lambda: 1.0)
    assert [top.next() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    top.reset()
    assert top.next() == 0.5
    low = Backoff(rng=lambda: 0.0)
    assert [low.next() for _ in range(3)] == [0.25, 0.5, 1]


def test_event_messages_hold_at_most_200_events_and_stay_under_the_frame_limit():
    import json

    small = [{"seq": i, "job": 1, "event": {"type": "step"}} for i in range(1, 451)]
    sizes = [len(json.loads(m)["events"]) for m in event_messages(small)]
    assert sizes == [200, 200, 50]
    big = [{"seq": i, "job": 1, "event": {"type": "device-error", "traceback": "x" * 60_000}} for i in range(1, 8)]
    messages = event_messages(big)
    assert all(len(m) < 256 * 1024 for m in messages) and len(messages) > 1
    assert [e["seq"] for m in messages for e in json.loads(m)["events"]] == list(range(1, 8))


# -- against the fake site ----------------------------------------------------------------------------


def test_hello_reports_the_device(site, agents):
    hello = site.messages("nano-1", "hello")[0][1]
    assert hello["kind"] == "jetson-nano" and hello["emulated"] is True
    assert hello["gflops"] == KINDS["jetson-nano"].gflops and hello["host_gflops"] == 30.0
    assert hello["memory_bytes"] == 4 * 2**30 and hello["address"] == "127.0.0.1" and hello["version"] == 1
    assert hello["session"] != site.messages("nx-0", "hello")[0][1]["session"]
    assert agents["nano-1"].device == "nano-1"


def test_a_two_device_run_survives_a_dropped_connection_and_uploads_its_parts(site, agents):
    job = next(jobs)
    plan = make_plan(MODEL, cluster_of("nx", "nano"), 8, 2, [(0, 9, [("nx-0", 4)]), (9, 21, [("nano-1", 4)])])
    site.drop_once("nx-0", after="device-start")  # mid-stream: steps are flowing when the site drops it
    for name in ("nx-0", "nano-1"):
        assign(site, job, plan, name, save_model=True)
    replies = {n: site.wait(lambda n=n: accepted(site, n, job), 30, f"{n} accepting") for n in ("nx-0", "nano-1")}
    port = replies["nx-0"]["port"]
    assert isinstance(port, int) and port > 0 and replies["nano-1"]["port"] is None  # rank 0 picked the store port
    for name in ("nx-0", "nano-1"):
        site.send(name, {"type": "start", "job": job, "host": "127.0.0.1", "port": port})
    for name in ("nx-0", "nano-1"):
        site.wait(lambda n=name: site.events(n, "device-done", job), START_S, f"{name} finishing")
    site.wait(lambda: any(m["state"] == "idle" for _, m in site.messages("nx-0", "heartbeat")[-3:]), 5, "idle")

    # the run: rank 0 reports every iteration; each device says it uploaded its part, without the bytes
    assert [e["iteration"] for e in site.events("nx-0", "iteration", job)] == [0, 1, 2]
    assert not site.events("nano-1", "iteration", job)
    for name in ("nx-0", "nano-1"):
        (done,) = site.events(name, "device-done", job)
        assert done["part"] is True and "state_dict" not in done
        assert not site.events(name, "device-error", job) and not site.events(name, "job-stopped", job)
    merged = {}
    for name in ("nx-0", "nano-1"):
        merged.update(torch.load(io.BytesIO(site.parts[(str(job), name)]), weights_only=True))
    assert set(merged) == set(get_model(MODEL).sequential().state_dict())

    # the drop: the agent came back after a backoff, in the same session, and resent exactly what was not stored
    hellos = site.messages("nx-0", "hello")
    assert len(hellos) == 2 and hellos[0][1]["session"] == hellos[1][1]["session"]
    assert 0.2 <= hellos[1][0] - site.dropped_at < 3.0
    *before, lost = [m for t, m in site.messages("nx-0", "events") if t <= site.dropped_at]
    after = [m for t, m in site.messages("nx-0", "events") if t > hellos[1][0]]
    assert lost["events"] == site.lost
    stored_before = before[-1]["events"][-1]["seq"]  # held without an ack: welcome's last_seq covers it
    assert site.lost[0]["seq"] == stored_before + 1
    assert after[0]["events"][0]["seq"] == stored_before + 1  # nothing stored is sent twice
    resent = {e["seq"]: e for m in after for e in m["events"]}
    assert all(resent[e["seq"]] == e for e in site.lost)  # the same seqs, the same events
    session = hellos[0][1]["session"]
    seqs = [e["seq"] for e in site.stored[("nx-0", session)]]
    assert seqs == list(range(1, len(seqs) + 1))

    # heartbeats kept coming every heartbeat_s while nano-1's device process trained
    t0, t1 = received_at(site, "nano-1", "device-start", job), received_at(site, "nano-1", "device-done", job)
    beats = heartbeats_between(site, "nano-1", t0, t1)
    assert len(beats) >= 3
    assert all(m["state"] == "busy" and m["job"] == job for _, m in beats)
    times = [t0] + [t for t, _ in beats] + [t1]
    assert max(b - a for a, b in zip(times, times[1:])) < 1.0


def test_cancel_stops_the_device_process_and_reports_job_stopped(site, agents):
    job, pid = start_solo(site, "nano-1", iterations=1000)
    cancelled = time.monotonic()
    site.send("nano-1", {"type": "cancel", "job": job})
    (stopped,) = site.wait(lambda: site.events("nano-1", "job-stopped", job), KILL_AFTER_S + 5, "job-stopped")
    assert stopped == {"type": "job-stopped", "device": "nano-1", "reason": "cancelled"}
    assert time.monotonic() - cancelled < KILL_AFTER_S + 5
    assert not alive(pid)
    assert not site.events("nano-1", "device-error", job) and not site.events("nano-1", "device-done", job)
    site.wait(
        lambda: (
            {k: v for k, v in site.messages("nano-1", "heartbeat")[-1][1].items() if k != "health"}
            == {"type": "heartbeat", "state": "idle", "job": None, "pending": 0}
        ),
        3,
        "idle",
    )


def test_a_job_assigned_right_after_a_cancel_waits_for_the_cancelled_process_and_is_accepted(site, agents):
    # the site frees a cancelled job's devices at once and may hand them the next job before they have stopped
    old, pid = start_solo(site, "nano-1", iterations=1000)
    site.send("nano-1", {"type": "cancel", "job": old})
    new = next(jobs)
    assign(site, new, solo_plan("nano-1"), "nano-1")
    site.wait(lambda: accepted(site, "nano-1", new), KILL_AFTER_S + 10, "the new job accepted")
    assert not alive(pid)
    site.wait(lambda: site.events("nano-1", "job-stopped", old), 5, "the cancelled job's job-stopped")
    assert not site.events("nano-1", "job-stopped", new)  # not refused as busy
    site.send("nano-1", {"type": "cancel", "job": new})


def test_a_device_process_that_dies_is_reported_as_its_own_failure(site, agents):
    job, pid = start_solo(site, "nx-0", iterations=1000)
    os.kill(pid, signal.SIGKILL)
    (stopped,) = site.wait(lambda: site.events("nx-0", "job-stopped", job), 10, "job-stopped")
    assert stopped["reason"] == "died"
    (error,) = site.events("nx-0", "device-error", job)
    assert error["cause"] == "own" and error["device"] == "nx-0" and "SIGKILL" in error["message"]
    assert error["iteration"] >= 0


def test_an_assignment_the_device_cannot_take_is_refused_with_a_reason(site, agents):
    job = next(jobs)
    plan = solo_plan("nano-1")
    site.send("nano-1", {"type": "assign", "job": job, "plan": plan.to_dict(), "rank": 3, "options": OPTIONS})
    (stopped,) = site.wait(lambda: site.events("nano-1", "job-stopped", job), 10, "job-stopped")
    assert stopped["reason"] == "rejected"
    (error,) = site.events("nano-1", "device-error", job)
    assert "rank 3 is not in the plan" in error["message"] and error["iteration"] == -1
    assert accepted(site, "nano-1", job) is None
    assert site.messages("nano-1", "heartbeat")[-1][1]["state"] == "idle"


def test_a_message_the_site_sends_before_the_welcome_is_handled_after_it():
    job = next(jobs)
    with FakeSite(DEVICES) as site:
        plan = solo_plan("nano-1")
        site.early["nano-1"] = [{"type": "assign", "job": job, "plan": plan.to_dict(), "rank": 3, "options": OPTIONS}]
        with running(make_agent(site, "nano-1")):
            (stopped,) = site.wait(lambda: site.events("nano-1", "job-stopped", job), 10, "job-stopped")
    assert stopped["reason"] == "rejected"  # answered, not skipped


def test_a_refused_credential_is_fatal(site):
    for credential, how in (("cred-revoked", "close code 4401"), ("cred-unknown", "HTTP 403")):
        agent = Agent(site.site, credential, capacity=capacity("nano-0"))
        started = time.monotonic()
        with pytest.raises(Refused, match=f"refused this device's credential \\({how}\\).*TOKEN=NEW_TOKEN"):
            agent.run()
        assert time.monotonic() - started < 5


def test_an_agent_waits_for_a_site_that_is_down_with_growing_delays(caplog):
    port = free_port()
    agent = make_agent(Site("http://127.0.0.1:1", f"ws://127.0.0.1:{port}/ws/agent/"), "tx2-2")
    thread = threading.Thread(target=agent.run, daemon=True)
    with caplog.at_level(logging.INFO, logger="workers"):
        thread.start()
        try:
            time.sleep(1.6)  # the site is down for the first few attempts (0.5 s, then 1 s, jittered)
            assert not agent.connected.is_set()
            with FakeSite(DEVICES, ws_port=port):
                assert agent.connected.wait(5)
        finally:
            agent.stop()
            thread.join(10)
    delays = [
        float(r.getMessage().split("retrying in ")[1].split()[0])
        for r in caplog.records
        if "retrying in" in r.getMessage()
    ]
    assert len(delays) >= 2 and 0.25 <= delays[0] <= 0.5 and 0.5 <= delays[1] <= 1.0


def test_stopping_the_agent_ends_its_run(site):
    agent = make_agent(site, "tx2-2")
    with running(agent):
        job, pid = start_solo(site, "tx2-2", iterations=1000)
    assert not alive(pid)  # stopped with the agent, not left training
    (stopped,) = site.events("tx2-2", "job-stopped", job)  # sent before the agent said goodbye
    assert stopped["reason"] == "agent-stopped"


def test_a_coordinated_start_needs_no_assign_and_a_killed_process_is_reported_as_lost(site, agents):
    """The site's coordinator starts a device into a generation itself (no assign first): the process joins the
    coordinator's store and beats; killed at the site's request it is a lost device (job-stopped, died, and how),
    not an error of its own."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.runtime.control import key

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    job = next(jobs)
    start = {"type": "start", "job": job, "coordinated": True, "name": "nano-1", "host": "127.0.0.1",
             "port": store.port, "generation": 0, "plan": solo_plan("nano-1").to_dict(), "options": OPTIONS,
             "predicted_iteration_s": 0.05}  # fmt: skip
    site.send("nano-1", {**start, "name": ""})  # malformed: refused with the reason (a device it cannot have)
    (refused,) = site.wait(lambda: site.events("nano-1", "job-stopped", job), 10, "the refusal")
    assert refused["reason"] == "rejected" and "needs a device name and a generation" in refused["why"]
    site.send("nano-1", start)
    beats = key("hb", "nano-1")
    site.wait(lambda: store.check([beats]) and store.add(beats, 0) > 0, START_S, "the device's heartbeats")
    site.send("nano-1", {"type": "kill", "job": job})
    site.wait(lambda: len(site.events("nano-1", "job-stopped", job)) == 2, 10, "job-stopped")
    stopped = site.events("nano-1", "job-stopped", job)[-1]
    assert stopped == {"type": "job-stopped", "device": "nano-1", "reason": "died", "why": "died (SIGKILL)"}
    assert not site.events("nano-1", "device-error", job)  # neither the refusal nor the loss is its own error


def test_a_coordinated_start_right_after_a_job_ended_waits_for_its_process_and_runs(site, agents):
    """The site frees a device when its job ends (finished or cancelled) and its next job's coordinator may
    start it before the old process has exited: the start is held until then, not refused as busy (a CI run lost
    three jobs of a lab to "this device is busy with job 2")."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.runtime.control import key

    old, pid = start_solo(site, "nano-1", iterations=1000)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    new = next(jobs)
    site.send("nano-1", {"type": "cancel", "job": old})
    site.send("nano-1", {"type": "start", "job": new, "coordinated": True, "name": "nano-1", "host": "127.0.0.1",
                         "port": store.port, "generation": 0, "plan": solo_plan("nano-1").to_dict(),
                         "options": OPTIONS, "predicted_iteration_s": 0.05})  # fmt: skip
    beats = key("hb", "nano-1")
    site.wait(lambda: store.check([beats]) and store.add(beats, 0) > 0, START_S, "the new job's heartbeats")
    assert not alive(pid)
    (stopped,) = site.events("nano-1", "job-stopped", old)
    assert stopped["reason"] == "cancelled"
    assert not site.events("nano-1", "job-stopped", new)  # not refused as busy
    site.send("nano-1", {"type": "kill", "job": new})
    site.wait(lambda: site.events("nano-1", "job-stopped", new), 10, "the new job's end")


def test_a_later_generation_of_the_same_job_supersedes_the_running_process(site, agents):
    """Another coordinators process took the job over (or its coordinator took this device for lost): its start
    of a later generation stops the process of the earlier one and starts a new one, saying nothing of the old."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    job = next(jobs)
    start = {"type": "start", "job": job, "coordinated": True, "name": "nano-1", "host": "127.0.0.1",
             "port": store.port, "generation": 0, "plan": solo_plan("nano-1").to_dict(),
             "options": {**OPTIONS, "iterations": 1000}, "predicted_iteration_s": 0.05}  # fmt: skip
    runner = agents["nano-1"].runner
    site.send("nano-1", start)
    first = site.wait(lambda: runner.pid, START_S, "generation 0's process")
    site.send("nano-1", {**start, "generation": 1})
    second = site.wait(lambda: (pid := runner.pid) not in (None, first) and pid, START_S, "generation 1's process")
    assert not alive(first) and alive(second)
    assert not site.events("nano-1", "job-stopped", job)  # the old process's end is news to nobody
    site.send("nano-1", {"type": "kill", "job": job})
    site.wait(lambda: site.events("nano-1", "job-stopped", job), 10, "the job's end")


# -- the clock probes ---------------------------------------------------------------------------------


def test_an_agent_estimates_its_clock_against_a_site_days_ahead(caplog):
    days = 3 * 86400 + 12.3  # the site's host booted three days before this one
    with FakeSite(DEVICES, clock_offset=days) as fake, caplog.at_level(logging.INFO, logger="workers"):
        with running(make_agent(fake, "tx2-2")) as agent:
            clock = agent.connection.clock
            fake.wait(lambda: clock.ready, 10, "a ready clock estimate")
            assert agent.runner.clock is clock and abs(clock.offset() - days) < 0.05 and clock.error_s < 0.05
            probes = [t for t, _ in fake.messages("tx2-2", "clock")]
            assert len(probes) >= 4 and probes[3] - probes[0] < 2.0  # the burst after welcome
    (told,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clock: offset to the site")]
    assert told.startswith("clock: offset to the site +259212.3")


def test_an_agent_tolerates_a_site_that_does_not_answer_clock_probes(site, agents):
    site.wait(lambda: len(site.messages("nx-0", "clock")) >= 8, 10, "the burst of clock probes")
    connection = agents["nx-0"].connection
    assert not connection.clock.ready and len(connection._probes) <= 16 and agents["nx-0"].connected.is_set()
    beats = len(site.messages("nx-0", "heartbeat"))
    site.wait(lambda: len(site.messages("nx-0", "heartbeat")) > beats, 5, "heartbeats going on")


def test_an_older_site_refusing_clock_probes_stops_them_quietly(caplog):
    with FakeSite(DEVICES, refuse_clock=True) as fake, caplog.at_level(logging.INFO, logger="workers"):
        with running(make_agent(fake, "tx2-2")) as agent:
            fake.wait(lambda: fake.messages("tx2-2", "clock"), 5, "a clock probe")
            time.sleep(0.5)
            sent = len(fake.messages("tx2-2", "clock"))
            time.sleep(0.5)
            assert len(fake.messages("tx2-2", "clock")) == sent < 8 and not agent.connection.clock.ready
    said = [r.getMessage() for r in caplog.records]
    assert said.count("the site does not answer clock probes; device times stay in this host's clock") == 1
    assert not [m for m in said if "rejected a message" in m]


def test_a_board_whose_copy_of_a_registered_model_differs_refuses_it(site, agents, tmp_path):
    """Issue 53: the site pins a registered model's file by its SHA-256; a board whose copy was changed says so."""
    import shutil

    from engine.models.source import pinned, reference

    copy = tmp_path / "lab_models.py"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "engine", "usermodels.py"), copy)
    ref = pinned(reference(f"{copy}:unet", "3,16,16"))
    copy.write_text(copy.read_text() + "\n# changed on this board only\n")
    job = next(jobs)
    cluster = Cluster((Device.of_kind("nano-1", "nano"),), name="test")
    plan = make_plan(ref, cluster, 8, 2, [(0, 6, [("nano-1", 4)])])
    site.send("nano-1", {"type": "assign", "job": job, "plan": plan.to_dict(), "rank": 0, "options": OPTIONS})
    (stopped,) = site.wait(lambda: site.events("nano-1", "job-stopped", job), 30, "job-stopped")
    assert stopped["reason"] == "rejected"
    (error,) = site.events("nano-1", "device-error", job)
    assert f"model {copy} is not the one planned for: its SHA-256 is" in error["message"], error["message"]
