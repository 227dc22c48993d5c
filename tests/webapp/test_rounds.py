"""Agents' event batches stored in rounds: what waits for the database thread goes in one transaction, each
watcher gets one frame per round, and a batch that fails loses only itself."""

import asyncio
import threading

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from tests.webapp.test_sockets import HELLO, agent_socket, enrolled, running_job, say, watching
from webapp.agents.consumers import FAILED
from webapp.agents.rounds import rounds
from webapp.devices.models import Device
from webapp.jobs.models import JobEvent

pytestmark = pytest.mark.django_db(transaction=True)


def steps(job, k: int) -> dict:
    """Device k's first batch: a step of its stage."""
    step = {"type": "step", "device": f"tx2-{k}", "stage": k, "micro_batch": 0, "kind": "F", "start": 0.0,
            "end": 0.1, "peer": "", "iteration": 0}  # fmt: skip
    return {"type": "events", "events": [{"seq": 1, "job": job.pk, "event": step}]}


async def _welcomed(credentials: list[str]) -> list[WebsocketCommunicator]:
    """An agent socket for each credential, said hello and welcomed."""
    agents = []
    for k, credential in enumerate(credentials):
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        assert (await say(ws, {**HELLO, "session": f"s{k}"}))["type"] == "welcome"
        agents.append(ws)
    return agents


async def _together(agents: list, messages: list[dict], meanwhile=None) -> None:
    """Each agent sends its message while the database thread is held, so that all wait for the same round, then
    `meanwhile()` (if given) runs and the thread is let go."""
    gate = threading.Event()
    held = asyncio.ensure_future(database_sync_to_async(gate.wait)(20))
    await asyncio.sleep(0.1)
    for ws, msg in zip(agents, messages, strict=True):
        await ws.send_json_to(msg)
    for _ in range(200):
        if len(rounds().waiting) >= len(agents):
            break
        await asyncio.sleep(0.02)
    assert len(rounds().waiting) == len(agents)
    if meanwhile is not None:
        await meanwhile()
    gate.set()
    await held


def test_batches_waiting_together_are_stored_in_one_round_and_relayed_as_one_frame(bob):
    devices = [enrolled(f"tx2-{k}") for k in range(3)]
    job = running_job(bob, [d for d, _ in devices])

    async def run():
        browser = await watching(bob, job)
        assert (await browser.receive_json_from(5))["type"] == "snapshot"
        agents = await _welcomed([credential for _, credential in devices])
        await _together(agents, [steps(job, k) for k in range(3)])
        for ws in agents:
            assert await ws.receive_json_from(5) == {"type": "ack", "seq": 1}
        frame = await browser.receive_json_from(5)
        assert frame["type"] == "batch"  # the round's three batches, one frame
        assert sorted(m["steps"][0]["device"] for m in frame["messages"]) == ["tx2-0", "tx2-1", "tx2-2"]
        assert await browser.receive_nothing(0.3)
        for ws in [*agents, browser]:
            await ws.disconnect()

    async_to_sync(run)()
    assert sorted(JobEvent.objects.filter(job=job, type="step").values_list("device", flat=True)) == [
        "tx2-0", "tx2-1", "tx2-2"
    ]  # fmt: skip
    assert sorted(Device.objects.values_list("last_seq", flat=True)) == [1, 1, 1]


def test_a_batch_that_fails_in_a_round_loses_only_itself(bob):
    (kept, kept_credential), (gone, gone_credential) = enrolled("tx2-0"), enrolled("tx2-1")
    job = running_job(bob, [kept, gone])

    async def run():
        agents = await _welcomed([kept_credential, gone_credential])
        # staff delete the second board while its batch waits: storing it fails, the round goes on
        removed = database_sync_to_async(Device.objects.filter(pk=gone.pk).delete, thread_sensitive=False)
        await _together(agents, [steps(job, 0), steps(job, 1)], meanwhile=removed)
        assert await agents[0].receive_json_from(5) == {"type": "ack", "seq": 1}
        closed = await agents[1].receive_output(5)
        assert closed == {"type": "websocket.close", "code": FAILED}  # not acknowledged: the agent sends it again
        await agents[0].disconnect()

    async_to_sync(run)()
    assert list(JobEvent.objects.filter(job=job, type="step").values_list("device", flat=True)) == ["tx2-0"]
    assert Device.objects.get(pk=kept.pk).last_seq == 1


def test_heartbeats_waiting_together_are_noted_in_one_round(bob):
    (idle, idle_credential), (busy, busy_credential), (off, off_credential) = (enrolled(f"tx2-{k}") for k in range(3))
    running_job(bob, [busy])

    async def run():
        agents = await _welcomed([idle_credential, busy_credential, off_credential])
        # the health check took the first two for offline; staff disabled the third
        await database_sync_to_async(
            lambda: (
                Device.objects.filter(pk__in=[idle.pk, busy.pk]).update(status="offline", last_heartbeat=None),
                Device.objects.filter(pk=off.pk).update(status="disabled", last_heartbeat=None),
            )
        )()
        beat = {"type": "heartbeat", "state": "idle", "job": None, "pending": 0}
        await _together(agents, [beat] * 3)
        for ws in agents:  # answered in order: the probe's reply comes once the heartbeat is noted
            assert (await say(ws, {"type": "events", "events": []}))["type"] == "error"
        noted = await database_sync_to_async(
            lambda: list(Device.objects.values_list("name", "status", "last_heartbeat"))
        )()
        for ws in agents:
            await ws.disconnect()
        return noted

    noted = async_to_sync(run)()
    assert {name: status for name, status, _ in noted} == {"tx2-0": "online", "tx2-1": "busy", "tx2-2": "disabled"}
    assert all(at is not None for _, _, at in noted)


def test_a_job_ended_by_one_batch_of_a_round_takes_no_more_iterations_from_the_next(bob):
    (first, first_credential), (second, second_credential) = enrolled("tx2-0"), enrolled("tx2-1")
    job = running_job(bob, [first, second])
    error = {"type": "device-error", "device": "tx2-0", "iteration": 0, "message": "died (SIGKILL)", "cause": "own"}
    iteration = {"type": "iteration", "iteration": 0, "loss": 2.3, "iteration_s": 0.08, "throughput": 100.0,
                 "late_steps": 0, "steps": 2, "time": 0.08}  # fmt: skip

    async def run():
        agents = await _welcomed([first_credential, second_credential])
        batches = [{"type": "events", "events": [{"seq": 1, "job": job.pk, "event": ev}]} for ev in (error, iteration)]
        await _together(agents, batches)
        for ws in agents:  # (the failed job's other device is told to cancel it too)
            replies = []
            while not await ws.receive_nothing(0.5):
                replies.append(await ws.receive_json_from(5))
            assert replies[-1] == {"type": "ack", "seq": 1}
            await ws.disconnect()

    async_to_sync(run)()
    job.refresh_from_db()
    assert job.status == "failed"
    assert not JobEvent.objects.filter(job=job, type="iteration").exists()  # the job had ended when it came
