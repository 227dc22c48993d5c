"""The sockets: agents (device credential, checked messages, de-duplicated events) and job pages (who may watch)."""

import asyncio
import json
import logging

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from webapp.accounts.models import ApiToken
from webapp.asgi import application
from webapp.devices.models import Device
from webapp.jobs import launching
from webapp.jobs.models import Job, JobDevice, JobEvent

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = {"type": "hello", "session": "s1", "kind": "jetson-tx2", "emulated": True, "memory_bytes": 8 * 2**30,
         "gflops": 1330.0, "host_gflops": 20.5, "address": "127.0.0.1", "version": 1}  # fmt: skip


def enrolled(name="tx2-0", kind="jetson-tx2") -> tuple[Device, str]:
    device = Device.objects.create(name=name, kind=kind)
    return Device.enroll(device.issue_enrollment())


def agent_socket(credential: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {credential}".encode())] if credential else []
    return WebsocketCommunicator(application, "/ws/agent/", headers=headers)


def running_job(owner, devices: list[Device]) -> Job:
    plan = {"method": "asteroid", "model": "mobilenetv2", "batch_size": 8, "micro_batches": 1,
            "stages": [{"layers": [0, 1], "devices": [{"name": d.name, "samples": 8}]} for d in devices],
            "cluster": {"devices": [{"name": d.name, "kind": d.kind} for d in devices]},
            "predicted": {"throughput": 100.0, "iteration_s": 0.08, "bubble_fraction": 0.0, "memory_bytes": {},
                          "fits": True}}  # fmt: skip
    job = Job.objects.create(owner=owner, model="mobilenetv2", plan=plan, status="running", iterations=2,
                             launched_at=timezone.now(), started_at=timezone.now())  # fmt: skip
    for rank, d in enumerate(devices):
        JobDevice.objects.create(job=job, device=d, name=d.name, rank=rank)
        Device.objects.filter(pk=d.pk).update(status="busy", job=job)
    return job


async def watching(user, job: Job) -> WebsocketCommunicator:
    """`user`'s browser socket on the job's page, connected (its first message, the snapshot, unread)."""
    _, token = await sync_to_async(ApiToken.issue)(user)
    browser = WebsocketCommunicator(
        application, f"/ws/jobs/{job.pk}/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    assert (await browser.connect())[0]
    return browser


async def say(ws, msg) -> dict:
    await ws.send_to(text_data=json.dumps(msg))
    return await ws.receive_json_from(timeout=5)


def test_agent_without_a_valid_credential_is_refused():
    async def run():
        for credential in (None, "ast_dev_forged"):
            ws = agent_socket(credential)
            connected, _ = await ws.connect()
            assert not connected
            await ws.disconnect()

    async_to_sync(run)()


def test_hello_heartbeat_and_bad_messages_keep_the_connection():
    device, credential = enrolled()

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        assert (await say(ws, {"type": "heartbeat", "state": "idle"}))["message"] == "say hello first"
        welcome = await say(ws, {**HELLO, "compute": "cuda", "gpu": "NVIDIA Tegra X2", "gpu_memory": 8 * 2**30})
        assert welcome == {"type": "welcome", "device": "tx2-0", "id": device.pk, "last_seq": 0, "heartbeat_s": 5}
        for bad, why in [
            (json.dumps({**HELLO, "compute": "tpu"}), "compute must be 'cpu' or 'cuda'"),
            ("not json", "not valid JSON"),
            ("[1, 2]", "a message must be a JSON object"),
            (json.dumps({"type": "reboot"}), "unknown message type 'reboot'"),
            (json.dumps({"type": "heartbeat", "state": "dancing"}), "state must be 'idle' or 'busy'"),
            (json.dumps({"type": "events", "events": [{"seq": "1", "job": 1, "event": {}}]}), "wrong type"),
            ("x" * (300 * 1024), "over the limit"),
        ]:
            await ws.send_to(text_data=bad)
            reply = await ws.receive_json_from(timeout=5)
            assert reply["type"] == "error" and why in reply["message"], (bad[:40], reply)
        await ws.send_to(text_data=json.dumps({"type": "heartbeat", "state": "idle", "job": None}))
        await ws.send_to(text_data=json.dumps({"type": "heartbeat", "state": "idle"}))
        assert await ws.receive_nothing(0.3)  # heartbeats are not answered, and the socket is still open
        await ws.disconnect()

    async_to_sync(run)()
    device.refresh_from_db()
    assert device.measured["host_gflops"] == 20.5 and device.address == "127.0.0.1"
    assert device.last_heartbeat is not None and device.status == "offline"  # idle and gone after disconnect
    assert device.computes_on == "GPU NVIDIA Tegra X2 (8.6 GB)"  # what the devices page shows


def test_events_are_stored_once_relayed_and_acknowledged(bob):
    device, credential = enrolled()
    job = running_job(bob, [device])
    step = {"type": "step", "device": "tx2-0", "stage": 0, "micro_batch": 0, "kind": "F", "start": 0.0, "end": 0.1,
            "peer": "", "iteration": 0, "generation": 0}  # fmt: skip
    iteration = {"type": "iteration", "iteration": 0, "loss": 2.3, "iteration_s": 0.08, "throughput": 100.0,
                 "late_steps": 0, "steps": 2, "time": 0.08}  # fmt: skip

    async def run():
        browser = await watching(bob, job)
        assert (await browser.receive_json_from(5))["type"] == "snapshot"
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        await say(ws, HELLO)
        batch = {"type": "events", "events": [{"seq": 1, "job": job.pk, "event": step},
                                              {"seq": 2, "job": job.pk, "event": iteration}]}  # fmt: skip
        assert await say(ws, batch) == {"type": "ack", "seq": 2}
        assert await say(ws, batch) == {"type": "ack", "seq": 2}  # a resend after a reconnect: dropped
        relayed = await browser.receive_json_from(5)  # one agent message, relayed as one
        assert relayed["type"] == "batch"
        got = relayed["messages"]
        assert got[0] == {"type": "steps", "steps": [{k: v for k, v in step.items() if k != "type"}]}
        assert got[1]["type"] == "iteration" and got[1]["loss"] == 2.3 and got[1]["throughput"] == 100.0
        assert await browser.receive_nothing(0.3)
        # The same agent process after a reconnect resumes from the last stored seq.
        await ws.disconnect()
        ws = agent_socket(credential)
        await ws.connect()
        assert (await say(ws, HELLO))["last_seq"] == 2
        assert (await say(ws, {**HELLO, "session": "s2"}))["last_seq"] == 0  # a new agent process starts over
        await ws.disconnect()
        await browser.disconnect()

    async_to_sync(run)()
    assert list(JobEvent.objects.filter(job=job).exclude(type="log").values_list("type", flat=True)) == [
        "step", "iteration"
    ]  # fmt: skip
    job.refresh_from_db()
    assert job.latest["loss"] == 2.3 and job.progress == 0.5


def test_launch_assign_accept_then_done(bob, settings):
    a, cred_a = enrolled("nx-0", "jetson-xavier-nx")
    b, cred_b = enrolled("tx2-0")
    Device.objects.filter(pk__in=[a.pk, b.pk]).update(status="online", measured={"emulated": True})
    plan = {"method": "asteroid", "model": "mobilenetv2", "batch_size": 8, "micro_batches": 1,
            "stages": [{"layers": [0, 5], "devices": [{"name": "nx-0", "samples": 8}]},
                       {"layers": [5, 20], "devices": [{"name": "tx2-0", "samples": 8}]}],
            "cluster": {"devices": [{"name": "nx-0", "kind": "nx"}, {"name": "tx2-0", "kind": "tx2"}]},
            "predicted": {"throughput": 100.0, "iteration_s": 0.08, "bubble_fraction": 0.0, "memory_bytes": {},
                          "fits": True}}  # fmt: skip
    job = Job.objects.create(owner=bob, model="mobilenetv2", plan=plan, status="planned", iterations=1)

    async def run():
        agents = {}
        for name, cred in (("nx-0", cred_a), ("tx2-0", cred_b)):
            agents[name] = agent_socket(cred)
            assert (await agents[name].connect())[0]
            await say(agents[name], {**HELLO, "session": name, "address": "10.0.0.7" if name == "nx-0" else "x"})
        await sync_to_async(launching.launch)(await sync_to_async(Job.objects.get)(pk=job.pk))
        assigned = {n: await ws.receive_json_from(5) for n, ws in agents.items()}
        assert {n: (m["type"], m["rank"]) for n, m in assigned.items()} == {
            "nx-0": ("assign", 0),
            "tx2-0": ("assign", 1),
        }
        assert assigned["nx-0"]["plan"] == plan and assigned["nx-0"]["options"]["iterations"] == 1
        await agents["tx2-0"].send_json_to({"type": "accepted", "job": job.pk, "port": None})
        assert await agents["nx-0"].receive_nothing(0.3)  # no start before everyone accepted
        assert (await sync_to_async(Job.objects.get)(pk=job.pk)).started_at is None
        await agents["nx-0"].send_json_to({"type": "accepted", "job": job.pk, "port": None})
        for ws in agents.values():  # the job's coordinator starts them (webapp/jobs/coordinating.py)
            assert await ws.receive_nothing(0.3)
        assert (await sync_to_async(Job.objects.get)(pk=job.pk)).started_at is not None
        for seq, (name, ws) in enumerate(agents.items(), 1):
            done = {"type": "device-done", "device": name, "late_steps": 0, "steps": 4, "part": False}
            assert await say(ws, {"type": "events", "events": [{"seq": seq, "job": job.pk, "event": done}]})
        for ws in agents.values():
            await ws.disconnect()

    async_to_sync(run)()
    job.refresh_from_db()
    assert job.status == "completed" and job.finished_at and job.started_at
    assert set(Device.objects.values_list("status", flat=True)) == {"offline"}  # freed, then both disconnected
    assert JobEvent.objects.filter(job=job, type="log", data__level="warning").exists()  # no parts: no model


def test_an_assign_lost_in_a_dead_connection_is_sent_again_when_the_agent_reconnects(bob):
    # a cable pulled and plugged back: the site still held the agent's socket for up when it launched the job
    a, cred_a = enrolled("nx-0", "jetson-xavier-nx")
    b, cred_b = enrolled("tx2-0")
    Device.objects.filter(pk__in=[a.pk, b.pk]).update(status="online", measured={"emulated": True})
    job = running_job(bob, [a, b])
    Job.objects.filter(pk=job.pk).update(status="planned", launched_at=None, started_at=None)
    JobDevice.objects.filter(job=job).delete()
    Device.objects.filter(pk__in=[a.pk, b.pk]).update(status="online", job=None)

    async def run():
        nx = agent_socket(cred_a)
        assert (await nx.connect())[0]
        await say(nx, {**HELLO, "session": "nx"})
        await sync_to_async(launching.launch)(await sync_to_async(Job.objects.get)(pk=job.pk))
        assert (await nx.receive_json_from(5))["type"] == "assign"  # tx2-0's went nowhere
        await nx.send_json_to({"type": "accepted", "job": job.pk, "port": 1234})
        tx2 = agent_socket(cred_b)  # its agent's socket reconnects: the welcome, then the assign it is owed
        assert (await tx2.connect())[0]
        assert (await say(tx2, {**HELLO, "session": "tx2"}))["type"] == "welcome"
        owed = await tx2.receive_json_from(5)
        assert (owed["type"], owed["job"], owed["rank"]) == ("assign", job.pk, 1)
        await tx2.send_json_to({"type": "accepted", "job": job.pk, "port": None})
        assert await tx2.receive_nothing(0.3)
        await nx.disconnect()
        again = agent_socket(cred_a)  # once it accepted, a reconnect owes nothing
        assert (await again.connect())[0]
        assert (await say(again, {**HELLO, "session": "nx"}))["type"] == "welcome"
        assert await again.receive_nothing(0.3)
        for ws in (again, tx2):
            await ws.disconnect()

    async_to_sync(run)()
    assert Job.objects.get(pk=job.pk).started_at is not None


def test_device_error_fails_the_job_and_cancels_the_others(bob):
    a, cred_a = enrolled("nx-0", "jetson-xavier-nx")
    b, cred_b = enrolled("tx2-0")
    job = running_job(bob, [a, b])

    async def run():
        ws_a, ws_b = agent_socket(cred_a), agent_socket(cred_b)
        for ws, name in ((ws_a, "nx-0"), (ws_b, "tx2-0")):
            await ws.connect()
            await say(ws, {**HELLO, "session": name})
        # its process crashed: the engine sends the traceback of what is neither a user's mistake nor a lost peer
        error = {"type": "device-error", "device": "tx2-0", "iteration": 1, "message": "CUDA error: an assert",
                 "cause": "own", "traceback": "Traceback (most recent call last): ..."}  # fmt: skip
        await ws_b.send_json_to({"type": "events", "events": [{"seq": 1, "job": job.pk, "event": error}]})
        assert await ws_a.receive_json_from(5) == {"type": "cancel", "job": job.pk}
        await ws_a.disconnect()
        await ws_b.disconnect()

    async_to_sync(run)()
    job.refresh_from_db()
    assert job.status == "failed" and job.message == "device tx2-0 failed during iteration 2: CUDA error: an assert"
    assert Device.objects.get(name="tx2-0").status == "failed"  # until staff enable it (or its agent starts again)


def test_a_job_failed_by_a_users_mistake_leaves_its_devices_online(bob):
    # regression: a job whose dataset was missing on the boards failed ("CIFAR-10 not found in ..."), and each
    # device that said so stayed `failed`, taking no new job, while its agent went on heartbeating
    a, cred_a = enrolled("nx-0", "jetson-xavier-nx")
    b, cred_b = enrolled("tx2-0")
    job = running_job(bob, [a, b])
    missing = "CIFAR-10 not found in /data: missing data_batch_1; put the python-version batch files there"

    async def run():
        ws_a, ws_b = agent_socket(cred_a), agent_socket(cred_b)
        for ws, name in ((ws_a, "nx-0"), (ws_b, "tx2-0")):
            await ws.connect()
            await say(ws, {**HELLO, "session": name})
        error = {"type": "device-error", "device": "tx2-0", "iteration": -1, "message": missing, "cause": "own",
                 "traceback": ""}  # fmt: skip
        await ws_b.send_json_to({"type": "events", "events": [{"seq": 1, "job": job.pk, "event": error}]})
        assert await ws_b.receive_json_from(5) == {"type": "ack", "seq": 1}
        assert await ws_a.receive_json_from(5) == {"type": "cancel", "job": job.pk}
        devices = await sync_to_async(list)(Device.objects.order_by("name").values_list("name", "status", "job"))
        await ws_a.disconnect()
        await ws_b.disconnect()
        return devices

    assert async_to_sync(run)() == [("nx-0", "online", None), ("tx2-0", "online", None)]  # ready for the next job
    job.refresh_from_db()
    assert job.status == "failed" and job.message == f"device tx2-0 failed while starting: {missing}"
    assert JobDevice.objects.get(job=job, name="tx2-0").state == "failed"  # its part of the job failed


def test_a_socket_to_an_unknown_path_is_refused_without_an_error(caplog):
    # regression: ws://HOST/ws/nothing/ was HTTP 500, with "ValueError: No route found for path" and its traceback
    async def run():
        for path in ("/ws/nothing/", "/ws/jobs/abc/", "/ws/agent/extra/", "/"):
            ws = WebsocketCommunicator(application, path)
            connected, _ = await ws.connect()
            assert not connected, path
            await ws.disconnect()

    async_to_sync(run)()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_job_socket_owner_staff_and_strangers(bob, carol, alice):
    device, _ = enrolled()
    job = running_job(bob, [device])

    async def connect(origin=b"http://127.0.0.1:8000", token=None):
        headers = [(b"origin", origin)] if origin else []
        if token:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        ws = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=headers)
        ok, _ = await ws.connect()
        out = await ws.receive_output(5) if ok else None
        await ws.disconnect()
        if out and out["type"] == "websocket.close":
            return out["code"], None  # accepted, then closed with a code the page can read
        return ok, json.loads(out["text"]) if out else None

    async def run():
        _, bob_token = await sync_to_async(ApiToken.issue)(bob)
        _, carol_token = await sync_to_async(ApiToken.issue)(carol)
        _, alice_token = await sync_to_async(ApiToken.issue)(alice)
        ok, first = await connect(token=bob_token, origin=None)
        assert ok and first["type"] == "snapshot" and first["job"]["id"] == job.pk and "devices" in first
        assert (await connect(token=carol_token, origin=None))[0] == 4404
        assert (await connect(token=alice_token, origin=None))[0] is True
        assert (await connect(token="ast_api_wrong", origin=None))[0] == 4401
        assert (await connect(origin=b"http://evil.example"))[0] is False  # cookie path: origin checked
        assert (await connect(origin=None))[0] is False  # no origin, no token

    async_to_sync(run)()


def test_a_disabled_device_stays_connected_but_disabled():
    device, credential = enrolled()
    Device.objects.filter(pk=device.pk).update(status="disabled")

    async def run():
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        assert (await say(ws, HELLO))["type"] == "welcome"
        await ws.send_json_to({"type": "heartbeat", "state": "idle"})
        await ws.disconnect()

    async_to_sync(run)()
    device.refresh_from_db()
    assert device.status == "disabled" and not device.available and device.last_heartbeat is not None


def test_held_out_scores_are_stored_relayed_and_in_the_jobs_json(bob, client):
    device, credential = enrolled()
    job = running_job(bob, [device])
    first = {"type": "eval", "iteration": 0, "loss": 2.1, "accuracy": 0.25, "perplexity": None, "samples": 256,
             "device_s": 0.4, "generation": 0}  # fmt: skip
    again = {**first, "loss": 1.9, "accuracy": 0.3, "generation": 1}  # the iteration replayed, scored again
    last = {**again, "iteration": 1, "loss": 1.5, "accuracy": 0.5}

    async def run():
        browser = await watching(bob, job)
        assert (await browser.receive_json_from(5))["job"]["eval"] == []
        ws = agent_socket(credential)
        assert (await ws.connect())[0]
        await say(ws, HELLO)
        ack = await say(ws, {"type": "events", "events": [{"seq": 1, "job": job.pk, "event": first}]})
        assert ack == {"type": "ack", "seq": 1}
        assert await browser.receive_json_from(5) == first
        batch = {"type": "events", "events": [{"seq": 2, "job": job.pk, "event": again},
                                              {"seq": 3, "job": job.pk, "event": last}]}  # fmt: skip
        assert await say(ws, batch) == {"type": "ack", "seq": 3}
        assert (await browser.receive_json_from(5))["messages"] == [again, last]
        await ws.disconnect()
        await browser.disconnect()

    async_to_sync(run)()
    assert JobEvent.objects.filter(job=job, type="eval").count() == 3
    client.force_login(bob)
    scores = client.get(f"/api/jobs/{job.pk}/").json()["eval"]
    assert scores == [{k: v for k, v in ev.items() if k != "type"} for ev in (again, last)]


async def bridged(ws) -> None:
    """One connection of a real agent (a websockets client) relayed to and from the site's consumer."""
    site = agent_socket(ws.request.headers.get("Authorization", "").removeprefix("Bearer "))
    connected, code = await site.connect()
    if not connected:
        await ws.close(code or 1011)
        return

    async def up():
        async for text in ws:
            await site.send_to(text_data=text)

    async def down():
        while (out := await site.receive_output(60))["type"] == "websocket.send":
            await ws.send(out["text"])
        await ws.close(out.get("code") or 1000)

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await site.disconnect()


def test_an_agent_connection_estimates_its_clock_against_the_site():
    """The agent's own session (workers/connection.py) against the site's consumer: its clock probes are answered,
    and on one host the estimate's offset is ~0."""
    from websockets.asyncio.server import serve

    from workers.connection import Connection
    from workers.device import Runner
    from workers.outbox import Outbox
    from workers.site import Site

    _, credential = enrolled()

    async def hello():
        return HELLO

    async def run():
        async with serve(bridged, "127.0.0.1", 0) as server:
            site = Site("http://127.0.0.1:1", f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/ws/agent/")
            outbox = Outbox()
            runner = Runner(site, credential, outbox)
            connection, stop = Connection(site, credential, hello, outbox, runner), asyncio.Event()
            session = asyncio.create_task(connection.run(stop))
            async with asyncio.timeout(20):
                while not connection.clock.ready:
                    await asyncio.sleep(0.05)
            stop.set()
            await session
        return connection, runner

    connection, runner = async_to_sync(run)()
    clock = connection.clock
    assert runner.clock is clock and clock.samples >= 4
    assert abs(clock.offset()) < 0.05 and clock.error_s < 0.05 and clock.drift_ppm == 0.0
