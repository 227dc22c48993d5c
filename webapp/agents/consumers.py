"""The agent socket `/ws/agent/`: device-token auth, checked messages; presence goes to the device, `accepted` and
`events` to its jobs (webapp.jobs.launching; webapp.agents.rounds stores events); `clock` probes are answered
with this host's monotonic clock, the time base of every host (workers/clock.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from engine.devices import canonical_probe
from webapp.agents.rounds import rounds
from webapp.devices import liveness
from webapp.devices.agents import agent_group
from webapp.devices.models import Device
from webapp.devices.protocol import ProtocolError, parse
from webapp.jobs.ending import reconcile
from webapp.jobs.launching import accepted, unanswered
from webapp.lib.dispatch import DirectDispatch
from webapp.lib.outage import UNREACHABLE, Outage, SocketOutage
from webapp.lib.pace import Pace
from webapp.lib.pooled import off_the_database_thread
from webapp.lib.tokens import bearer

log = logging.getLogger(__name__)
_heard = Outage(log, "Redis for the heartbeats' times", "heartbeats are noted in the database alone meanwhile")

REFUSED = 4401  # close code: bad or revoked credential
FAILED = SocketOutage.CLOSED  # close code: the site could not handle a message
INBOX = 64  # an agent's messages waiting for the database (an agent has one events message unacknowledged at a time)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _device_of(scope) -> Device | None:
    return Device.for_credential(bearer(_header(scope, b"authorization")))


# One read, so it need not wait for daphne's one database thread, where every socket's stored batches queue: a lab
# reconnecting at once (a daphne restarted) is let in, and its heartbeats heard, while that thread catches up.
_authenticate = off_the_database_thread(_device_of)


@database_sync_to_async
def _hello(device: Device, msg: dict) -> list[dict]:
    """The replies to a hello: `welcome`, then the `assign` the agent is owed, if any."""
    device.refresh_from_db()
    if msg["session"] != device.session:  # a new agent process numbers its events from 1 again
        if device.session:  # ... and runs nothing of what the one before it had taken part in
            reconcile(device, None, restarted=True)
            device.refresh_from_db(fields=["status", "job"])
        device.session, device.last_seq = msg["session"], 0
    fields = ("kind", "emulated", "memory_bytes", "gflops", "host_gflops", "link_mbps", "datasets")
    fields += ("compute", "gpu", "gpu_memory")  # where it computes (engine.runtime.placement.Accelerator)
    device.measured = {k: msg.get(k) for k in fields}
    if msg.get("probe") is not None:  # a board of no known kind: planned with the latency predictor
        device.measured["probe"] = json.loads(canonical_probe(msg["probe"]))  # checked in protocol: only its layers
    device.address = msg.get("address") or ""
    device.last_heartbeat = timezone.now()
    if device.status in (Device.Status.OFFLINE, Device.Status.FAILED):
        device.status = Device.Status.BUSY if device.job_id else Device.Status.ONLINE
    device.save(update_fields=["session", "last_seq", "measured", "address", "last_heartbeat", "status"])
    if msg["kind"] != device.kind:
        log.warning("device %s is registered as %s but its agent reports %s", device.name, device.kind, msg["kind"])
    welcome = {
        "type": "welcome",
        "device": device.name,
        "id": device.pk,
        "last_seq": device.last_seq,
        "heartbeat_s": settings.ASTEROID_HEARTBEAT_S,
    }
    return [welcome, *filter(None, [unanswered(device)])]


@database_sync_to_async
def _accepted(device: Device, msg: dict) -> None:
    accepted(device, msg["job"])


def _connection_key(device: Device) -> str:
    return f"asteroid:agent-connection:{device.pk}"


def _newest(device: Device, channel: str) -> None:
    cache.set(_connection_key(device), channel, None)


# The device's newest connection, noted at its handshake (off the database thread, like `_authenticate`): an older one
# closing after it (a cable pulled and plugged back, its FIN and the new SYN on the wire together) is not the agent
# gone, whether or not the new one has said hello yet.
_note_newest = off_the_database_thread(_newest)


@database_sync_to_async
def _gone(device: Device, channel: str) -> None:
    """The agent's connection closed: offline, unless a newer connection of it was made meanwhile (a board whose
    cable was pulled reconnects before the site notices its old socket is dead). A newer one that goes before its
    hello leaves the device as it was: silent, it goes offline by its heartbeats (webapp.devices.liveness)."""
    if cache.get(_connection_key(device)) not in (None, channel):
        return
    Device.objects.filter(pk=device.pk, status=Device.Status.ONLINE, job__isnull=True).update(
        status=Device.Status.OFFLINE
    )


class AgentConsumer(SocketOutage, DirectDispatch, AsyncWebsocketConsumer):
    """One connected agent. Bad messages get an `error` reply and are logged; the connection stays up."""

    device: Device | None = None

    async def connect(self):
        self.device = await _authenticate(self.scope)
        if self.device is None:  # a disabled device stays connected (and visible), it just gets no jobs
            await self.close(code=REFUSED)
            return
        self.group = agent_group(self.device.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await _note_newest(self.device, self.channel_name)
        await self.accept()
        self.welcomed = False
        self.early: list[dict] | None = []  # the site's messages to the agent before its welcome went out
        # Events past the agent's share wait their turn: its acks slow down and its outbox holds the rest.
        self.pace = Pace(settings.ASTEROID_AGENT_EVENTS_PER_S, 2 * settings.ASTEROID_AGENT_EVENTS_PER_S)
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=INBOX)
        self.worker = asyncio.create_task(self._work())

    async def disconnect(self, code):
        if self.device is not None:
            self.worker.cancel()  # what it had not stored yet was not acknowledged: the agent sends it again
            await self.channel_layer.group_discard(agent_group(self.device.pk), self.channel_name)
            if getattr(self, "welcomed", False):
                await _gone(self.device, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None):
        """Read at once, whatever the database thread is doing: a clock probe is answered and a heartbeat noted
        as alive (webapp.devices.liveness) here; the rest, replies to bad frames included, waits its turn in
        `inbox` and is answered in order."""
        received = time.monotonic()  # a `clock` probe's t1: before anything else, parsing included
        try:
            msg = parse(text_data, settings.ASTEROID_AGENT_MAX_MESSAGE)
            if msg["type"] != "hello" and not self.welcomed:
                raise ProtocolError("say hello first")
        except ProtocolError as exc:
            log.warning("device %s: rejected a message: %s", self.device.name, exc)
            msg = {"type": "error", "message": str(exc)}
        if msg["type"] == "clock":  # answered at once, no database: the agent times the round trip
            await self.send_json({"type": "clock", "t0": msg["t0"], "t1": received, "t2": time.monotonic()})
            return
        if msg["type"] == "hello":
            self.welcomed = True
        elif msg["type"] == "heartbeat":
            try:
                await liveness.heard(self.device.pk)
            except UNREACHABLE as exc:  # Redis restarting: the database notes the heartbeat all the same
                _heard.failed(exc)
        await self.inbox.put(msg)  # a full inbox holds the socket's reading back, as one handler at a time did

    async def _work(self) -> None:
        """The agent's messages in order, each once the one before is done (most need the database); a failure
        closes the socket (the agent reconnects and sends again what was not acknowledged)."""
        try:
            while True:
                msg = await self.inbox.get()
                if msg["type"] == "error":  # a frame the site did not take
                    await self.send_json(msg)
                elif msg["type"] == "hello":
                    for reply in await _hello(self.device, msg):
                        await self.send_json(reply)
                    early, self.early = self.early or [], None
                    for message in early:  # a coordinator's `start`, say, sent while the hello waited its turn
                        await self.send_json(message)
                elif msg["type"] == "heartbeat":
                    await rounds().record(self.device, msg)
                elif msg["type"] == "accepted":
                    await _accepted(self.device, msg)
                elif msg["type"] == "events":
                    await self.pace.take(len(msg["events"]) + len(msg["rejected"]))
                    for seq, why in msg["rejected"]:  # acknowledged below all the same: the stream goes on without it
                        log.warning("device %s: dropped event %d: %s", self.device.name, seq, why)
                        await self.send_json({"type": "error", "message": f"event {seq} dropped: {why}"})
                    await self.send_json({"type": "ack", "seq": await rounds().record(self.device, msg)})
        except asyncio.CancelledError:
            raise
        except UNREACHABLE as exc:  # Redis restarting (the connection's note in the cache): one line per outage
            self._outage.failed(exc)
            await self.close(code=FAILED)
        except Exception:
            log.exception("device %s: handling its message failed; closing its socket", self.device.name)
            await self.close(code=FAILED)

    def stopped(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.cancel()  # (disconnect is not called when daphne stops, or the channel layer failed)

    async def send_json(self, message: dict) -> None:
        await self.send(text_data=json.dumps(message))

    async def agent_message(self, event):
        """A message from the site (webapp.devices.agents.tell_agent) to this agent: after its welcome, which an
        agent waits for first (it skips anything before it), so one that comes earlier is held until then."""
        if self.early is not None:
            self.early.append(event["message"])
        else:
            await self.send_json(event["message"])

    async def agent_revoked(self, event):
        await self.close(code=REFUSED)
