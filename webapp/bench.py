"""Benchmarks of a running site, from the outside: `python -m webapp.bench live --url http://127.0.0.1:PORT`.

`live` measures how long an agent's event takes to reach the browsers watching its job: agent -> /ws/agent/ ->
the site stores and applies it -> the job's Channels group -> /ws/jobs/<id>/ -> every subscriber. Everything is
real and goes through the site's public means only:

1. an API token (`manage.py createtoken USER`, run with this environment, or --token);
2. a device (`POST /api/devices/`, or a new enrollment token for an existing one: `POST /api/devices/<id>/token/`),
   enrolled like a board (workers/enroll.py) for a device credential;
3. an agent on `/ws/agent/` (hello, heartbeats, `accepted` with a free port after `assign`);
4. a job on that device only (`POST /api/jobs/`, planned by the site's Celery worker, `POST .../launch/`);
5. N subscribers on `/ws/jobs/<id>/` with the API token, in a second process so that receiving does not delay
   sending; each notes when every `iteration` arrives (alone, or inside a `{"type": "batch"}` message);
6. the agent sends the catalogue's `iteration` events (engine/events.py) at --rate per second, one per `events`
   message or --batch per message, open loop (on a fixed schedule whatever the site does);
7. the job is cancelled at the end (nothing else is removed: the device stays registered for the next run).

Latency = receive time - send time, both time.monotonic() on this host (system-wide on Linux). An event a
subscriber has not received GRACE_S (5 s) after the last send is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from workers.site import error_message

ROOT = Path(__file__).resolve().parent.parent
LOCAL_HOSTS = ("127.0.0.1", "localhost")
GRACE_S = 5.0  # after the last send, how long subscribers may still receive before an event counts as lost
WINDOW_S = 10.0  # the first and last windows whose p99 shows growth
MAX_BATCH = 200  # events per `events` message (docs/protocol.md)
MAX_SUBSCRIBERS = 1000
MAX_RATE = 10_000.0
MAX_SECONDS = 3600.0
MAX_DELIVERIES = 20_000_000  # subscribers x events: what the receive records may hold

# The job the events belong to: one Xavier NX, a small model and batch (it must plan and fit), many iterations
# (the site's maximum) so that progress is not capped during long runs.
DEVICE_KIND = "jetson-xavier-nx"
MODEL, BATCH_SIZE, ITERATIONS = "mobilenetv2", 8, 100_000

HTTP_TIMEOUT_S = 30.0
TOKEN_TIMEOUT_S = 120.0  # manage.py createtoken (imports Django)
CONNECT_TIMEOUT_S = 15.0
PLAN_TIMEOUT_S = 300.0  # the first plan of a model profiles it on the site's host
START_TIMEOUT_S = 60.0  # launch -> assign -> accepted -> start
SUBSCRIBE_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
MAX_FRAME = 64 * 1024 * 1024


class BenchError(Exception):
    """Something that stops the benchmark; printed as one line."""


# -- command line ----------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def _positive_float(high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"must be above 0 and at most {high:g}, got {text}")
        return value

    return parse


def local_url(text: str) -> str:
    """The site's base URL: http(s) on 127.0.0.1 or localhost only (this is a load generator)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL like http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL like http://127.0.0.1:8000")
    if parts.hostname not in LOCAL_HOSTS:
        raise argparse.ArgumentTypeError(
            f"only a site on 127.0.0.1 or localhost may be benchmarked, got {parts.hostname}"
        )
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} has a query or fragment; give the site's base URL")
    netloc = parts.hostname + (f":{port}" if port else "")
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def device_name(text: str) -> str:
    if not text or len(text) > 64 or not all(c.isalnum() or c in "-_." for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name (1-64 letters, digits, '-', '_', '.')")
    return text


EPILOG = f"""\
what it does (nothing but the site's public API and sockets):
  a token from `manage.py createtoken USER` (run here, with this environment: set the same
  ASTEROID_VAR_DIR / DATABASE_URL as the site) unless --token; a device DEVICE registered (or given a new
  enrollment token) and enrolled; an agent on /ws/agent/; a job of {MODEL}, batch {BATCH_SIZE}, {ITERATIONS}
  iterations on that device alone, planned and launched; SUBSCRIBERS sockets on /ws/jobs/<id>/; RATE iteration
  events per second for SECONDS, BATCH per `events` message; then the job is cancelled.
  An event not received {GRACE_S:g} s after the last send is lost. Latencies are in ms; the p99 of the first
  and last {WINDOW_S:g} s (half the run when shorter) shows whether delays grow.

example:
  ASTEROID_PORT=18555 ASTEROID_CLUSTER=none .venv/bin/python -m webapp.startsite &
  .venv/bin/python -m webapp.bench live --url http://127.0.0.1:18555 --subscribers 20 --rate 100 --seconds 60
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m webapp.bench", description="Benchmarks of a running Asteroid site.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    live = sub.add_parser(
        "live",
        help="latency of live events: agent -> site -> N subscribers of one job",
        description="Latency of live events from a device agent, through the site, to N sockets watching its job.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    live.add_argument("--url", required=True, type=local_url, help="the site, e.g. http://127.0.0.1:8000 (local only)")
    live.add_argument("--token", help="a staff member's API token (default: a new one from manage.py createtoken)")
    live.add_argument("--user", default="admin", help="staff account for manage.py createtoken (default: admin)")
    live.add_argument(
        "--subscribers", type=_int_in(1, MAX_SUBSCRIBERS), default=20, help="sockets on the job (default 20)"
    )
    live.add_argument("--rate", type=_positive_float(MAX_RATE), default=100.0, help="events per second (default 100)")
    live.add_argument("--seconds", type=_positive_float(MAX_SECONDS), default=60.0, help="sending time (default 60)")
    live.add_argument(
        "--batch",
        type=_int_in(1, MAX_BATCH),
        default=1,
        help=f"events per `events` message, sent every BATCH/RATE s (default 1, at most {MAX_BATCH})",
    )
    live.add_argument(
        "--device", type=device_name, default="bench-live", help="the benchmark's device (default bench-live)"
    )
    live.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    live.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments; a mistake exits with one line (status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(message: str):
        parser.exit(2, f"{parser.prog} {args.command}: error: {message} (see --help)\n")

    if args.command == "live":
        events = round(args.rate * args.seconds)
        if events < 1:
            fail(f"--rate {args.rate:g} for --seconds {args.seconds:g} sends no event; send at least one")
        if events * args.subscribers > MAX_DELIVERIES:
            fail(
                f"{events} events to {args.subscribers} subscribers is over {MAX_DELIVERIES} deliveries; "
                "lower --rate, --seconds or --subscribers"
            )
        if args.token is not None and not args.token.strip():
            fail("--token is empty")
    return args


# -- the site's HTTP API ---------------------------------------------------------------------------------------


class Api:
    """JSON over HTTP with `Authorization: Bearer TOKEN`; every failure is a BenchError line."""

    def __init__(self, base: str, token: str):
        self.base, self.token = base, token

    def call(self, method: str, path: str, doc: dict | None = None, ok: tuple[int, ...] = ()) -> tuple[int, dict]:
        body = json.dumps(doc).encode() if doc is not None else (b"" if method == "POST" else None)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                return reply.status, _json_object(reply.read(), path)
        except urllib.error.HTTPError as exc:
            message = error_message(exc)
            if exc.code in ok:
                return exc.code, {"error": message}
            if exc.code == 401:
                raise BenchError(f"the site refused the API token ({message})") from None
            raise BenchError(f"{method} {path}: HTTP {exc.code}: {message}") from None
        except urllib.error.URLError as exc:
            raise BenchError(f"cannot reach the site at {self.base}: {exc.reason}") from None
        except OSError as exc:
            raise BenchError(f"cannot reach the site at {self.base}: {exc}") from None

    def get(self, path: str) -> dict:
        return self.call("GET", path)[1]

    def post(self, path: str, doc: dict | None = None) -> dict:
        return self.call("POST", path, doc)[1]


def _json_object(text: bytes, path: str) -> dict:
    try:
        doc = json.loads(text) if text.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise BenchError(f"the reply to {path} is not JSON: is this an Asteroid site?") from None
    if not isinstance(doc, dict):
        raise BenchError(f"the reply to {path} is not a JSON object: is this an Asteroid site?")
    return doc


def create_token(user: str) -> str:
    """A new API token from `manage.py createtoken USER` (its last line), run with this process's environment."""
    command = [sys.executable, "manage.py", "createtoken", user, "--name", "bench"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TOKEN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"manage.py createtoken {user} took over {TOKEN_TIMEOUT_S:.0f} s; pass --token") from None
    except OSError as exc:
        raise BenchError(f"cannot run manage.py createtoken: {exc}") from None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        why = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise BenchError(f"manage.py createtoken {user} failed: {why[-1] if why else f'exit {done.returncode}'}")
    return lines[-1]


# -- the agent -------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _socket_url(base: str, path: str) -> str:
    parts = urlsplit(base)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return f"{scheme}://{parts.netloc}{parts.path}{path}"


class Agent:
    """A device agent reduced to what the benchmark needs: hello, heartbeats, accepting one job, sending
    numbered `events` messages and timing their acknowledgements, and `job-stopped` after a cancel."""

    def __init__(self, url: str, credential: str):
        self.url, self.credential = url, credential
        self.session = secrets.token_hex(8)
        self.seq = 0
        self.acked = 0
        self.name = ""
        self.job: int | None = None  # the job it runs (after `assign`)
        self.expected: int | None = None  # the job whose `assign` it will accept
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.stopped_acked = asyncio.Event()
        self.stopped_seq = 0
        self.errors: list[str] = []  # the site's `error` replies
        self.unexpected: list[str] = []
        self.in_flight: list[tuple[int, float]] = []  # (last seq of a message, send time), in order
        self.ack_s: list[float] = []
        self.heartbeat_s = 5.0
        self.ws = None
        self.tasks: list[asyncio.Task] = []

    async def connect(self) -> None:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.credential}"}
        self.ws = await connect(
            self.url, additional_headers=headers, open_timeout=CONNECT_TIMEOUT_S, max_size=MAX_FRAME
        )
        hello = {
            "type": "hello",
            "session": self.session,
            "kind": DEVICE_KIND,
            "emulated": True,
            "memory_bytes": 8 * 1024**3,
            "gflops": 1690.0,
            "host_gflops": 0.0,
            "address": "127.0.0.1",
            "version": 1,
        }
        await self.ws.send(json.dumps(hello))
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            while True:
                msg = _load(await self.ws.recv())
                if msg.get("type") == "welcome":
                    break
                if msg.get("type") == "error":
                    raise BenchError(f"the site rejected the agent's hello: {msg.get('message')}")
        self.name = str(msg.get("device") or "")
        every = msg.get("heartbeat_s")
        if isinstance(every, int | float) and not isinstance(every, bool) and every > 0:
            self.heartbeat_s = float(every)
        self.tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._heartbeats())]

    async def _heartbeats(self) -> None:
        while True:
            busy = self.job is not None and not self.cancelled.is_set()
            beat = {"type": "heartbeat", "state": "busy" if busy else "idle", "job": self.job if busy else None}
            await self.ws.send(json.dumps({**beat, "pending": self.seq - self.acked}))
            await asyncio.sleep(self.heartbeat_s)

    async def _receive(self) -> None:
        async for raw in self.ws:
            now = time.monotonic()
            msg = _load(raw)
            kind = msg.get("type")
            if kind == "ack":
                seq = msg.get("seq") if type(msg.get("seq")) is int else 0
                self.acked = max(self.acked, seq)
                while self.in_flight and self.in_flight[0][0] <= seq:
                    self.ack_s.append(now - self.in_flight.pop(0)[1])
                if self.stopped_seq and seq >= self.stopped_seq:
                    self.stopped_acked.set()
            elif kind == "assign":
                if msg.get("job") == self.expected and self.job is None:
                    self.job = msg["job"]
                    port = free_port() if msg.get("rank") == 0 else None
                    await self.ws.send(json.dumps({"type": "accepted", "job": self.job, "port": port}))
                else:
                    self.unexpected.append(f"assign of job {msg.get('job')}")
            elif kind == "start":
                if msg.get("job") == self.job:
                    self.started.set()
            elif kind == "cancel":
                if msg.get("job") == self.job and not self.cancelled.is_set():
                    self.cancelled.set()
                    await self._stopped()
            elif kind == "error":
                self.errors.append(str(msg.get("message")))
            else:
                self.unexpected.append(f"message of type {kind!r}")

    async def _stopped(self) -> None:
        """What an agent answers to `cancel`: a `job-stopped` event."""
        from engine.events import JobStopped

        event = JobStopped(device=self.name, reason="cancelled").to_message()
        self.stopped_seq = await self.send_events([event])

    async def send_events(self, events: list[dict], job: int | None = None) -> int:
        """One `events` message; returns its last seq."""
        items = []
        for ev in events:
            self.seq += 1
            items.append({"seq": self.seq, "job": job if job is not None else self.job, "event": ev})
        text = json.dumps({"type": "events", "events": items})
        self.in_flight.append((self.seq, time.monotonic()))
        await self.ws.send(text)
        return self.seq

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.ws is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.ws.close()
            except (TimeoutError, OSError):
                pass

    def check_alive(self) -> None:
        """Raise a BenchError when the agent's socket has ended (its receive task finished)."""
        for task in self.tasks:
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                code = getattr(self.ws, "close_code", None)
                raise BenchError(f"the agent's socket closed ({exc or f'close code {code}'})")


def _load(raw) -> dict:
    try:
        msg = json.loads(raw)
    except (ValueError, TypeError):
        return {}
    return msg if isinstance(msg, dict) else {}


# -- the subscribers (a child process) -------------------------------------------------------------------------


def subscribers_main(url: str, token: str, count: int, conn) -> None:
    """Entry point of the subscribers' process: `count` sockets on `url`; talks to the parent over `conn`."""
    try:
        asyncio.run(_subscribers(url, token, count, conn))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # the parent prints it as one line
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()


async def _subscribers(url: str, token: str, count: int, conn) -> None:
    from websockets.asyncio.client import connect

    records: list[list[tuple[int, float]]] = [[] for _ in range(count)]
    seen: list[set[int]] = [set() for _ in range(count)]
    messages: Counter = Counter()
    statuses: list[dict] = []
    ended: list[str] = []
    sockets = []
    closing = False  # set once the benchmark closes the sockets itself

    async def open_one(i: int):
        ws = await connect(
            url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=SUBSCRIBE_TIMEOUT_S,
            max_size=MAX_FRAME,
        )  # fmt: skip
        first = _load(await ws.recv())
        if first.get("type") != "snapshot":
            raise BenchError(f"subscriber {i}: expected a snapshot first, got {first.get('type')!r}")
        sockets.append(ws)
        return ws

    async def listen(i: int, ws) -> None:
        mine, got = records[i], seen[i]
        try:
            async for raw in ws:
                now = time.monotonic()
                msg = _load(raw)
                kind = msg.get("type")
                messages[kind] += 1
                inner = msg.get("messages") if kind == "batch" and isinstance(msg.get("messages"), list) else [msg]
                for m in inner:
                    if not isinstance(m, dict):
                        continue
                    if m.get("type") == "iteration" and type(m.get("iteration")) is int:
                        if m["iteration"] not in got:
                            got.add(m["iteration"])
                            mine.append((m["iteration"], now))
                    elif m.get("type") == "status" and i == 0:
                        statuses.append({k: m.get(k) for k in ("status", "message")})
                    if kind == "batch":
                        messages[f"batch:{m.get('type')}"] += 1
        except Exception as exc:  # noqa: BLE001 - a subscriber that drops is reported, not fatal
            if closing:
                return
            ended.append(f"subscriber {i}: {type(exc).__name__}: {exc}")
            return
        if not closing:
            ended.append(f"subscriber {i}: closed by the site (code {ws.close_code})")

    opened = await asyncio.gather(*(open_one(i) for i in range(count)), return_exceptions=True)
    failures = [r for r in opened if isinstance(r, BaseException)]
    listeners = [asyncio.create_task(listen(i, ws)) for i, ws in enumerate(opened) if not isinstance(ws, BaseException)]
    conn.send(("ready", count - len(failures), f"{type(failures[0]).__name__}: {failures[0]}" if failures else None))
    command = await asyncio.to_thread(_recv, conn)
    if command and command[0] == "end":
        _, events, grace = command
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(len(s) < events for s in seen):
            await asyncio.sleep(0.02)
    closing = True
    for ws in sockets:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await ws.close()
        except (TimeoutError, OSError):
            pass
    for task in listeners:
        task.cancel()
    await asyncio.gather(*listeners, return_exceptions=True)
    conn.send(("result", records, dict(messages), statuses, ended))


def _recv(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


class Subscribers:
    """The child process with the subscribers, seen from the parent."""

    def __init__(self, url: str, token: str, count: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=subscribers_main, args=(url, token, count, child), daemon=True)
        self.proc.start()
        child.close()
        self.count = count

    async def _get(self, timeout: float, what: str):
        ready = await asyncio.to_thread(self.conn.poll, timeout)
        if not ready:
            raise BenchError(f"the subscribers did not {what} within {timeout:.0f} s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise BenchError(
                f"the subscribers' process ended (exit {self.proc.exitcode}) before it could {what}"
            ) from None
        if reply[0] == "error":
            raise BenchError(f"subscribers: {reply[1]}")
        return reply

    async def ready(self) -> None:
        _, opened, failure = await self._get(SUBSCRIBE_TIMEOUT_S + 10, "connect")
        if opened < self.count:
            raise BenchError(f"only {opened} of {self.count} subscribers could connect to the job ({failure})")

    async def finish(self, events: int, grace: float) -> tuple:
        self.conn.send(("end", events, grace))
        _, records, messages, statuses, ended = await self._get(grace + CLOSE_TIMEOUT_S + 30, "report")
        return records, messages, statuses, ended

    def stop(self) -> None:
        try:
            self.conn.send(("abort",))
        except OSError:
            pass
        self.proc.join(CLOSE_TIMEOUT_S + 5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


# -- the run ---------------------------------------------------------------------------------------------------


def say(args, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


def enrollment(api: Api, name: str) -> tuple[dict, str]:
    """The benchmark's device and a fresh enrollment token: registered now, or re-issued for an existing one."""
    devices = api.get("/api/devices/").get("devices", [])
    device = next((d for d in devices if isinstance(d, dict) and d.get("name") == name), None)
    if device is None:
        status, reply = api.call("POST", "/api/devices/", {"name": name, "kind": DEVICE_KIND}, ok=(403,))
    else:
        if device.get("status") == "disabled":
            raise BenchError(f"device {name} is disabled; enable it on the Devices page or pass --device OTHER")
        if device.get("job"):
            raise BenchError(f"device {name} is busy with job {device['job']}; cancel it or pass --device OTHER")
        status, reply = api.call("POST", f"/api/devices/{device['id']}/token/", ok=(403,))
    if status == 403:
        raise BenchError(f"the API token's user may not add or enroll devices ({reply['error']}); use a staff account")
    token = reply.get("enrollment_token")
    if not isinstance(token, str) or not token:
        raise BenchError("the site gave no enrollment token: is this an Asteroid site?")
    return reply.get("device") or {}, token


async def wait_for_status(api: Api, job_id: int, wanted: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = await asyncio.to_thread(api.get, f"/api/jobs/{job_id}/")
        status = job.get("status")
        if status == wanted:
            return job
        if status in ("failed", "cancelled", "completed"):
            raise BenchError(f"job {job_id} is {status}: {job.get('message') or 'no reason given'}")
        if time.monotonic() > deadline:
            raise BenchError(f"job {job_id} is still {status} after {timeout:.0f} s ({job.get('message')})")
        await asyncio.sleep(0.25)


async def send_iterations(agent: Agent, job: int, rate: float, seconds: float, batch: int) -> dict:
    """The open-loop sender: event i is due at t0 + i / rate, in messages of `batch` sent when their first is due."""
    from engine.events import Iteration

    total = round(rate * seconds)
    interval = batch / rate
    sent_at: dict[int, float] = {}
    lateness: list[float] = []
    t0 = time.monotonic() + 0.05
    for k in range(math.ceil(total / batch)):
        due = t0 + k * interval
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        agent.check_alive()
        now = time.monotonic()
        lateness.append(max(0.0, now - due))
        numbers = range(k * batch, min(total, (k + 1) * batch))
        events = [
            Iteration(
                iteration=i,
                loss=2.3 * math.exp(-3.0 * i / total),
                iteration_s=1.0 / rate,
                throughput=BATCH_SIZE * rate,
                steps=4 * (i + 1),
                time=round(now - t0, 6),  # seconds since the first send: the send time, recoverable from the event
            ).to_message()
            for i in numbers
        ]
        await agent.send_events(events, job)
        for i in numbers:
            sent_at[i] = now
    return {"t0": t0, "end": time.monotonic(), "sent_at": sent_at, "messages": len(lateness), "lateness": lateness}


async def run_live(args) -> dict:
    from workers.enroll import enroll
    from workers.site import Site

    started = datetime.now(UTC)
    token = args.token.strip() if args.token else None
    if token is None:
        say(args, f"creating an API token: manage.py createtoken {args.user}")
        token = await asyncio.to_thread(create_token, args.user)
    api = Api(args.url, token)
    await asyncio.to_thread(api.get, "/api/jobs/")  # reachable, and the token works
    device, enrollment_token = await asyncio.to_thread(enrollment, api, args.device)
    site = Site.parse(args.url)
    state = await asyncio.to_thread(enroll, site, enrollment_token, 1)
    say(args, f"device {args.device} enrolled; agent connecting to {site.socket_url}")
    agent = Agent(site.socket_url, state.credential)
    subscribers: Subscribers | None = None
    job_id = None
    result: dict = {}
    try:
        await agent.connect()
        job = await asyncio.to_thread(
            api.post,
            "/api/jobs/",
            {"model": MODEL, "dataset": "synthetic", "batch_size": BATCH_SIZE, "iterations": ITERATIONS,
             "devices": [agent.name or args.device]},
        )  # fmt: skip
        job_id = job.get("id")
        if type(job_id) is not int:
            raise BenchError("the site's reply to POST /api/jobs/ has no job id")
        say(args, f"job {job_id} created; waiting for the site to plan it")
        await wait_for_status(api, job_id, "planned", PLAN_TIMEOUT_S)
        agent.expected = job_id
        await asyncio.to_thread(api.post, f"/api/jobs/{job_id}/launch/")
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await agent.started.wait()
        except TimeoutError:
            raise BenchError(
                f"job {job_id} was launched but the site sent no start within {START_TIMEOUT_S:.0f} s"
            ) from None
        from engine.events import DeviceStart

        await agent.send_events([DeviceStart(device=agent.name, rank=0, stage=0, pid=os.getpid()).to_message()])
        say(args, f"job {job_id} running; connecting {args.subscribers} subscribers")
        subscribers = Subscribers(_socket_url(args.url, f"/ws/jobs/{job_id}/"), token, args.subscribers)
        await subscribers.ready()
        say(args, f"sending {args.rate:g} events/s for {args.seconds:g} s, {args.batch} per message")
        try:
            async with asyncio.timeout(args.seconds * 2 + 30):  # the sender falls behind only if sends block
                sent = await send_iterations(agent, job_id, args.rate, args.seconds, args.batch)
        except TimeoutError:
            raise BenchError(f"sending took over {args.seconds * 2 + 30:.0f} s: the site stopped reading") from None
        say(args, f"sent; waiting up to {GRACE_S:g} s for the subscribers to receive everything")
        records, messages, statuses, ended = await subscribers.finish(len(sent["sent_at"]), GRACE_S)
        final = await asyncio.to_thread(api.get, f"/api/jobs/{job_id}/")
        result = summarize(args, sent, records, agent, messages, statuses, ended)
        result.update(job=job_id, device=agent.name, job_status_at_end=final.get("status"), date=started.isoformat())
    finally:
        if subscribers is not None:
            await asyncio.to_thread(subscribers.stop)
        if job_id is not None:
            await _cancel(api, agent, job_id)
        await agent.close()
    return result


async def _cancel(api: Api, agent: Agent, job_id: int) -> None:
    """Cancel the job (a finished one stays as it is) and let the agent's `job-stopped` be stored."""
    try:
        await asyncio.to_thread(api.call, "POST", f"/api/jobs/{job_id}/cancel/", None, (409,))
    except BenchError as exc:
        print(f"warning: could not cancel job {job_id}: {exc}", file=sys.stderr)
        return
    if agent.job is None:
        return
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await agent.cancelled.wait()
            await agent.stopped_acked.wait()
    except TimeoutError:
        pass


# -- statistics ------------------------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of sorted `values` (None for none)."""
    if not values:
        return None
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


def latency_stats(values_s: list[float]) -> dict:
    ordered = sorted(values_s)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "count": len(ordered),
        "p50": ms(percentile(ordered, 50)),
        "p90": ms(percentile(ordered, 90)),
        "p99": ms(percentile(ordered, 99)),
        "max": ms(ordered[-1] if ordered else None),
    }


def summarize(args, sent: dict, records: list, agent: Agent, messages: dict, statuses: list, ended: list) -> dict:
    sent_at, t0 = sent["sent_at"], sent["t0"]
    events = len(sent_at)
    # from the first send to the end of the last message's slot (the last message is sent batch/rate before it)
    duration = max(sent_at.values()) - t0 + args.batch / args.rate if sent_at else 0.0
    window = min(WINDOW_S, args.seconds / 2)
    all_s, first_s, last_s, per_subscriber = [], [], [], []
    by_second: dict[int, list[float]] = {}  # latencies by the second (since the first send) they were sent in
    for mine in records:
        lat = []
        for iteration, received in mine:
            at = sent_at.get(iteration)
            if at is None:
                continue
            delay = received - at
            lat.append(delay)
            offset = at - t0
            if offset < window:
                first_s.append(delay)
            if offset >= args.seconds - window:
                last_s.append(delay)
            by_second.setdefault(int(offset), []).append(delay)
        all_s.extend(lat)
        per_subscriber.append(latency_stats(lat)["p99"])
    stats = latency_stats(all_s)
    lateness = sorted(sent["lateness"])
    ack = sorted(agent.ack_s)
    known = [p for p in per_subscriber if p is not None]
    return {
        "config": {
            "url": args.url,
            "subscribers": args.subscribers,
            "rate": args.rate,
            "seconds": args.seconds,
            "batch": args.batch,
            "grace_s": GRACE_S,
            "window_s": window,
        },
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_1min": _load_average(),  # at the end: other work on the host skews every number
        },
        "sent": {
            "events": events,
            "messages": sent["messages"],
            "seconds": round(duration, 3),
            "rate": round(events / duration, 1) if duration > 0 else None,
            "late_p99_ms": round(percentile(lateness, 99) * 1000, 2) if lateness else None,
            "late_max_ms": round(lateness[-1] * 1000, 2) if lateness else None,
        },
        "ack_ms": latency_stats(ack),
        "deliveries": stats["count"],
        "expected": events * args.subscribers,
        "lost": events * args.subscribers - stats["count"],
        "latency_ms": stats,
        "first_window": {"seconds": window, **latency_stats(first_s)},
        "last_window": {"seconds": window, **latency_stats(last_s)},
        "subscriber_p99_ms": {"min": min(known), "max": max(known)} if known else None,
        "p99_by_second_ms": [latency_stats(by_second.get(k, []))["p99"] for k in range(math.ceil(duration - 1e-6))],
        "messages": messages,
        "job_statuses": statuses,
        "subscribers_ended": ended,
        "site_errors": agent.errors[:20],
        "unexpected": agent.unexpected[:20],
    }


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def render(result: dict) -> str:
    c, s, lat = result["config"], result["sent"], result["latency_ms"]
    w = c["window_s"]
    header = ["subscribers", "rate/s", "batch", "seconds", "deliveries", "lost", "p50 ms", "p90 ms", "p99 ms",
              "max ms", f"p99 first {w:g} s", f"p99 last {w:g} s"]  # fmt: skip
    row = [str(c["subscribers"]), f"{c['rate']:g}", str(c["batch"]), f"{c['seconds']:g}", str(result["deliveries"]),
           str(result["lost"]), _ms(lat["p50"]), _ms(lat["p90"]), _ms(lat["p99"]), _ms(lat["max"]),
           _ms(result["first_window"]["p99"]), _ms(result["last_window"]["p99"])]  # fmt: skip
    ack = result["ack_ms"]
    lines = [
        f"live event latency: job {result.get('job')}, device {result.get('device')}, {result.get('date', '')[:19]}Z, "
        f"{result['host']['cpus']} CPUs, load average {result['host']['load_average_1min']} at the end",
        f"sent {s['events']} iteration events in {s['messages']} messages over {s['seconds']:.1f} s "
        f"({s['rate']} events/s; sender behind schedule p99 {_ms(s['late_p99_ms'])} ms, "
        f"max {_ms(s['late_max_ms'])} ms)",
        f"site's ack of an events message: p50 {_ms(ack['p50'])} ms, p99 {_ms(ack['p99'])} ms, "
        f"max {_ms(ack['max'])} ms",
        "",
        table(header, [row]),
        "",
    ]
    if result["subscriber_p99_ms"]:
        sp = result["subscriber_p99_ms"]
        lines.append(f"per-subscriber p99: {_ms(sp['min'])} to {_ms(sp['max'])} ms")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(result["messages"].items(), key=lambda kv: str(kv[0])))
    lines.append(f"messages received by the subscribers: {kinds or 'none'}")
    lines.append(f"job status at the end: {result.get('job_status_at_end')} (then cancelled)")
    for st in result["job_statuses"]:
        lines.append(f"warning: the job's status changed during the run: {st['status']}: {st['message']}")
    for line in result["subscribers_ended"][:5]:
        lines.append(f"warning: {line}")
    for message in result["site_errors"][:5]:
        lines.append(f"warning: the site answered the agent with an error: {message}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = asyncio.run(run_live(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a benchmark reports any failure as one line, never a traceback
        from engine.errors import UserError

        if isinstance(exc, UserError):
            print(f"error: {exc}", file=sys.stderr)
        else:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
