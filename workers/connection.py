"""The agent's WebSocket session with the site: hello/welcome, events with acks and resends, heartbeats, clock
probes, reconnects.

Everything here runs on one asyncio loop that never does heavy work: training is in a child process,
and preparing a job (which may profile a model) runs in a worker thread, so heartbeats always go out.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI, WebSocketException

from engine.errors import UserError
from workers.clock import ClockSync
from workers.device import Runner
from workers.outbox import Outbox
from workers.site import Site

log = logging.getLogger("workers.connection")
# asyncio.wait_for's timeout (not `asyncio.timeout`, new in 3.11): the builtin TimeoutError from Python 3.11, a class
# of its own on 3.10, JetPack 6's Python, which the agent runs on beside NVIDIA's torch
WAIT_TIMEOUT = asyncio.TimeoutError  # noqa: UP041

REFUSED_CODE = 4401  # close code of a bad or revoked credential
MAX_EVENTS = 200  # events per `events` message (protocol)
MAX_MESSAGE_BYTES = 192 * 1024  # under the site's 256 KiB frame limit
# Sends of `events` messages not yet acknowledged, at most; then newer events wait (and go in one message) for the
# oldest's ack, or ACK_WAIT_S. Before, newer events waited at most 0.2 s: a site minutes behind got five messages a
# second from each agent, its sockets' queues filled, and the heartbeats queued behind them went unread (boards taken
# for offline, their jobs failed: 27 of 50 at the control-plane benchmark's full load on two daphne processes).
WINDOW = 2
ACK_WAIT_S = 30.0  # (the site acknowledges every message it takes, or closes the socket: this is a safety net)
WELCOME_TIMEOUT_S = 10.0
DEFAULT_HEARTBEAT_S = 5.0
CLOCK_BURST = 8  # clock probes right after welcome, CLOCK_BURST_GAP_S apart ...
CLOCK_BURST_GAP_S = 0.05
CLOCK_EVERY_S = 5.0  # ... then one every CLOCK_EVERY_S
CLOCK_IN_FLIGHT = 16  # the t0s of probes not yet answered; older ones are forgotten (their replies ignored)


class Refused(UserError):
    """The site refused the device credential: fatal, the device has to be enrolled again."""


class Backoff:
    """Reconnect delays: 0.5 s doubling up to 30 s, each drawn in [d/2, d] so agents do not reconnect in step."""

    def __init__(self, first: float = 0.5, cap: float = 30.0, rng: Callable[[], float] = random.random):
        self.first, self.cap, self.rng = first, cap, rng
        self.reset()

    def reset(self) -> None:
        self._next = self.first

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, delay * 2)
        return delay * (0.5 + 0.5 * self.rng())


class _Wakeup:
    """Wakes the sender when the outbox gets an event, from whichever thread added it (one loop call per wait)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._event = asyncio.Event()
        self._scheduled = False  # a wake-up is on its way to the loop

    def added(self) -> None:
        """The outbox's watcher: any thread, after an add. (Set means the sender reads the outbox before waiting.)"""
        if self._scheduled or self._event.is_set():
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop has closed: the next session sends what is pending
            self._scheduled = False

    def _set(self) -> None:
        self._scheduled = False
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self) -> None:
        await self._event.wait()


class _Acked:
    """The highest seq the site acknowledged in this session, and a wait for one."""

    def __init__(self, seq: int = 0):
        self.seq = seq
        self._changed = asyncio.Event()

    def note(self, seq: int) -> None:
        if seq > self.seq:
            self.seq = seq
            self._changed.set()

    async def until(self, seq: int, timeout: float) -> None:
        """Return once `seq` is acknowledged, or after `timeout` seconds."""

        async def acknowledged() -> None:
            while self.seq < seq:
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(acknowledged(), timeout)
        except WAIT_TIMEOUT:
            pass


def event_messages(entries: list[dict]) -> list[str]:
    """`events` messages (JSON text) carrying `entries` in order: at most MAX_EVENTS and ~MAX_MESSAGE_BYTES each."""
    messages, parts, size = [], [], 0
    for entry in entries:
        text = json.dumps(entry)
        if parts and (len(parts) == MAX_EVENTS or size + len(text) > MAX_MESSAGE_BYTES):
            messages.append('{"type": "events", "events": [' + ", ".join(parts) + "]}")
            parts, size = [], 0
        parts.append(text)
        size += len(text) + 2
    if parts:
        messages.append('{"type": "events", "events": [' + ", ".join(parts) + "]}")
    return messages


class Connection:
    """Keeps one session with the site alive until `stop` is set; raises Refused for a refused credential."""

    def __init__(
        self,
        site: Site,
        credential: str,
        hello: Callable[[], Awaitable[dict]],
        outbox: Outbox,
        runner: Runner,
        backoff: Backoff | None = None,
        health: Callable[[], dict] | None = None,
    ):
        self.site, self.credential, self.hello = site, credential, hello
        self.health = health  # this board's health, sampled for each heartbeat (workers.health)
        self.outbox, self.runner = outbox, runner
        self.backoff = backoff or Backoff()
        self.device: str | None = None  # the site's name for this device, from `welcome`
        self.connected = threading.Event()  # set while a session is up (after `welcome`)
        # This host's clock against the site's, kept across reconnects (the clocks do not change); the runner
        # hands its estimate to device processes.
        self.clock = ClockSync()
        runner.clock = self.clock
        self._probes: deque[float] = deque(maxlen=CLOCK_IN_FLIGHT)  # t0s of probes in flight
        self._clock_told = False  # the estimate's first readiness is logged, once
        self._clock_unanswered = False  # the site said it does not know `clock` (an older site): no more probes
        self._acked = _Acked()  # this session's acknowledgements, which pace the sender

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, and reconnect with backoff until `stop`; buffered events wait in the outbox meanwhile."""
        while not stop.is_set():
            try:
                await self._until_stopped(stop)
                reason = "closed by the site"
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    raise self._refused(f"HTTP {status}") from None
                reason = f"the site answered HTTP {status}"
            except ConnectionClosed as exc:
                if exc.rcvd is not None and exc.rcvd.code == REFUSED_CODE:
                    raise self._refused(f"close code {REFUSED_CODE}") from None
                reason = f"connection lost ({exc.rcvd.code if exc.rcvd else 'no close frame'})"
            except InvalidURI as exc:
                raise UserError(f"bad agent socket URL {self.site.socket_url}: {exc}") from None
            except (OSError, TimeoutError, WebSocketException) as exc:
                reason = str(exc) or type(exc).__name__
            finally:
                if self.connected.is_set():
                    self.connected.clear()
            if stop.is_set():
                break
            delay = self.backoff.next()
            log.info("disconnected from %s: %s; retrying in %.1f s", self.site.url, reason, delay)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except WAIT_TIMEOUT:
                pass

    async def _until_stopped(self, stop: asyncio.Event) -> None:
        """One session; a stop while connecting abandons it, a stop once connected lets it say goodbye."""
        session = asyncio.create_task(self._session(stop))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({session, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not session.done() and not self.connected.is_set():
                session.cancel()
            await asyncio.gather(session, return_exceptions=True)
        finally:
            stopped.cancel()
            session.cancel()  # a no-op once it is done; takes it along if this task itself is cancelled
        if not session.cancelled():
            session.result()

    def _refused(self, how: str) -> Refused:
        return Refused(
            f"the server refused this device's credential ({how}): it was revoked or is unknown; enroll again with "
            f"a new token from the site: make agent SERVER={self.site.url} TOKEN=NEW_TOKEN"
        )

    async def _session(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.credential}"}
        tls = {"ssl": self.site.tls} if self.site.tls is not None else {}  # wss: the pinned CA, the board's cert
        async with connect(
            self.site.socket_url, additional_headers=headers, open_timeout=WELCOME_TIMEOUT_S, **tls
        ) as ws:
            await ws.send(json.dumps(await self.hello()))
            welcome, early = await self._welcome(ws)
            self.device = welcome.get("device")
            self.runner.device = self.device or ""
            self.outbox.ack(_int(welcome.get("last_seq")))
            self._acked = _Acked(_int(welcome.get("last_seq")))
            every = welcome.get("heartbeat_s")
            every = every if isinstance(every, int | float) and not isinstance(every, bool) and every > 0 else None
            self.backoff.reset()
            self._clock_unanswered = False  # the site may have been upgraded since
            self.connected.set()
            log.info("connected to %s as %s (%d events to resend)", self.site.url, self.device, len(self.outbox))
            tasks = [
                asyncio.create_task(self._receive(ws, early)),
                asyncio.create_task(self._send_events(ws)),
                asyncio.create_task(self._heartbeats(ws, every or DEFAULT_HEARTBEAT_S)),
                asyncio.create_task(self._clock_probes(ws)),
                asyncio.create_task(stop.wait()),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if stop.is_set():
                await self._goodbye(ws)
                return
            for task in done:
                task.result()  # the exception that ended the session (ConnectionClosed, mostly)

    async def _welcome(self, ws: ClientConnection) -> tuple[dict, list[tuple[dict, float]]]:
        """The site's reply to hello, and what came before it (a site that sends a coordinator's `start` ahead of
        the welcome): kept, with when it came, and handled once connected."""
        early = []

        async def welcome() -> dict:
            while True:
                raw = await ws.recv()
                received, msg = time.monotonic(), _parse(raw)
                if msg.get("type") == "welcome":
                    return msg
                log.info("the site sent %s before its welcome; handled after it", _describe(msg))
                early.append((msg, received))

        try:
            return await asyncio.wait_for(welcome(), WELCOME_TIMEOUT_S), early
        except WAIT_TIMEOUT:
            raise TimeoutError(f"no welcome from the site in {WELCOME_TIMEOUT_S} s") from None

    async def _goodbye(self, ws: ClientConnection) -> None:
        """Stopping: end any run (its `job-stopped` event included) and send what is left, briefly."""
        await asyncio.to_thread(self.runner.shutdown)

        async def send_pending() -> None:
            for text in event_messages(self.outbox.pending()):
                await ws.send(text)

        try:
            await asyncio.wait_for(send_pending(), 2.0)
        except (WAIT_TIMEOUT, ConnectionClosed):
            pass

    async def _receive(self, ws: ClientConnection, early: list[tuple[dict, float]]) -> None:
        for msg, received in early:
            await self._handle(ws, msg, received)
        async for raw in ws:
            received = time.monotonic()  # a `clock` reply's t3
            await self._handle(ws, _parse(raw), received)

    async def _handle(self, ws: ClientConnection, msg: dict, received: float) -> None:
        """One message from the site (`received`: when it came, in this host's monotonic clock)."""
        kind = msg.get("type")
        if kind == "clock":
            self._clock_reply(msg, received)
        elif kind == "ack":
            self.outbox.ack(_int(msg.get("seq")))
            self._acked.note(_int(msg.get("seq")))
        elif kind == "assign":
            await self._assign(ws, msg)
        elif kind == "start":
            try:
                self.runner.start(msg)
            except UserError as exc:
                log.warning("cannot start job %s: %s", msg.get("job"), exc)
                # a coordinator's start refused is a device it cannot have (job-stopped), not a failed job
                self.runner.refuse(msg.get("job"), str(exc), own=msg.get("coordinated") is not True)
        elif kind == "cancel":
            self.runner.cancel(msg.get("job"))
        elif kind == "kill":
            try:
                self.runner.kill(msg.get("job"))
            except UserError as exc:  # gone already: a lost device's coordinator makes sure, after a staff kill too
                log.info("nothing to kill: %s", exc)
        elif kind == "error" and "unknown message type 'clock'" in str(msg.get("message")):
            if not self._clock_unanswered:
                log.info("the site does not answer clock probes; device times stay in this host's clock")
            self._clock_unanswered = True
        elif kind == "error":
            log.warning("the site rejected a message: %s", msg.get("message"))
        else:
            log.warning("ignoring %s", _describe(msg))

    async def _assign(self, ws: ClientConnection, msg: dict) -> None:
        """Prepare the job off the loop (it may profile the model), then reply `accepted`; or refuse it."""
        job = msg.get("job")
        try:
            reply = await asyncio.to_thread(self.runner.assign, msg)
        except Exception as exc:  # any reason this device cannot take part goes back to the site, not up
            log.warning("refusing job %s: %s", job, exc)
            self.runner.refuse(job, str(exc) or type(exc).__name__)
            return
        await ws.send(json.dumps(reply))

    async def _send_events(self, ws: ClientConnection) -> None:
        """Everything not yet acknowledged (a resend after welcome), then new events as soon as they are added.

        What has accumulated goes in one message. Up to WINDOW sends await their acks (the site has stored them);
        then newer events wait for the oldest's: an event added to an idle connection goes at once, and under load
        the site gets a message from this agent as fast as it stores them, each as large as what came meanwhile."""
        wake = _Wakeup(asyncio.get_running_loop())
        self.outbox.watch(wake.added)
        try:
            sent = 0
            in_flight: deque[int] = deque()  # the last seq of each send not yet acknowledged
            while True:
                while in_flight and in_flight[0] <= self._acked.seq:
                    in_flight.popleft()
                if len(in_flight) >= WINDOW:
                    await self._acked.until(in_flight[0], ACK_WAIT_S)
                    if in_flight[0] > self._acked.seq:  # no ack for that long: send on all the same
                        in_flight.popleft()
                    continue
                wake.clear()  # before reading: an add after this read wakes it again
                entries = self.outbox.pending(after=sent)
                if not entries:
                    await wake.wait()
                    continue
                for text in event_messages(entries):
                    await ws.send(text)
                sent = entries[-1]["seq"]
                in_flight.append(sent)
        finally:
            self.outbox.watch(None)

    async def _clock_probes(self, ws: ClientConnection) -> None:
        """A burst of probes, then one every CLOCK_EVERY_S; replies come to `_clock_reply`, or never. (It never
        returns: the session ends when one of its tasks does.)"""
        for k in itertools.count():
            if not self._clock_unanswered:
                t0 = time.monotonic()
                self._probes.append(t0)
                await ws.send(json.dumps({"type": "clock", "t0": t0}))
            await asyncio.sleep(CLOCK_BURST_GAP_S if k < CLOCK_BURST - 1 else CLOCK_EVERY_S)

    def _clock_reply(self, msg: dict, t3: float) -> None:
        t0, t1, t2 = msg.get("t0"), msg.get("t1"), msg.get("t2")
        if t0 not in self._probes:  # not ours, answered twice, or forgotten: nothing to time
            log.debug("ignoring a clock reply to no probe in flight (t0 %r)", t0)
            return
        self._probes.remove(t0)
        if not self.clock.add(t0, t1, t2, t3):
            log.debug("dropped a malformed clock reply %s", msg)
        elif self.clock.ready and not self._clock_told:
            self._clock_told = True
            log.info("clock: offset to the site %+.3f s (±%.1f ms)", self.clock.offset(), self.clock.error_s * 1e3)

    async def _heartbeats(self, ws: ClientConnection, every: float) -> None:
        while True:
            await self._heartbeat(ws)
            await asyncio.sleep(every)

    async def _heartbeat(self, ws: ClientConnection) -> None:
        # state before pending: a run that ends in between leaves its last events counted as pending
        beat = {"type": "heartbeat", "state": self.runner.state, "job": self.runner.job}
        if self.health is not None:
            beat["health"] = await asyncio.to_thread(self.health)  # (nvidia-smi may take a moment)
        await ws.send(json.dumps({**beat, "pending": len(self.outbox)}))


def _parse(raw) -> dict:
    try:
        msg = json.loads(raw)
    except (ValueError, TypeError):
        return {"type": None, "raw": str(raw)[:80]}
    return msg if isinstance(msg, dict) else {"type": None, "raw": str(raw)[:80]}


def _describe(msg: dict) -> str:
    return f"message of type {msg['type']!r}" if msg.get("type") else f"malformed message {msg.get('raw', msg)!r}"


def _int(value) -> int:
    return value if type(value) is int else 0
