"""A small fake site for agent tests: the HTTP API (enroll, part upload) and `/ws/agent/` of docs/protocol.md.

The HTTP side is a stdlib ThreadingHTTPServer, the socket a `websockets` server on its own loop thread,
both on 127.0.0.1 with free ports. It records every message, stores events as the real site does (only
seqs above the last stored one per device and session), acknowledges them, and can be told to drop one
connection in the middle of a stream. It leaves `clock` probes unanswered, unless given a `clock_offset` (its
clock then reads `time.monotonic() + clock_offset`) or told to `refuse_clock` as a site older than `clock` does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import ExitStack
from http import HTTPStatus

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from tests.workers.httpfakes import JsonHandler, serving
from workers.site import Site


class FakeSite:
    """`devices`: name -> credential; `tokens`: enrollment token -> device name (single use)."""

    def __init__(
        self,
        devices: dict[str, str],
        tokens: dict[str, str] | None = None,
        heartbeat_s: float = 0.2,
        ws_port: int = 0,
        clock_offset: float | None = None,
        refuse_clock: bool = False,
        ack_delay_s: float = 0.0,
    ):
        self.credentials = {cred: name for name, cred in devices.items()}
        self.tokens = dict(tokens or {})
        self.revoked: set[str] = set()  # credentials refused after the handshake (close 4401)
        self.heartbeat_s, self.ws_port = heartbeat_s, ws_port
        self.clock_offset, self.refuse_clock = clock_offset, refuse_clock
        # A site behind: each ack goes this long after its message is stored, while the site reads on.
        self.ack_delay_s, self.unacked, self.most_unacked = ack_delay_s, 0, 0
        self._acks: set[asyncio.Task] = set()
        self.lock = threading.Lock()
        self.received: list[tuple[float, str, dict]] = []  # (monotonic time, device, message), every message
        self.stored: dict[tuple[str, str], list[dict]] = {}  # (device, session) -> stored event entries
        self.lost: list[dict] = []  # entries of the message the site "lost" when it dropped a connection
        self.dropped_at: float | None = None
        self.parts: dict[tuple[str, str], bytes] = {}  # (job, device) -> uploaded bytes
        self._drop: dict[str, str] = {}  # device -> event type whose message triggers the drop
        self.early: dict[str, list[dict]] = {}  # device -> messages sent ahead of its next welcome (once)
        self._sockets: dict[str, object] = {}
        self._loop = asyncio.new_event_loop()

    # -- lifecycle ------------------------------------------------------------------------------------

    def __enter__(self) -> FakeSite:
        self._http = ExitStack()
        self.http_url = self._http.enter_context(serving(_handler(self)))
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._ws = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._http.close()

    async def _serve(self):
        return await serve(self._session, "127.0.0.1", self.ws_port, process_request=self._check)

    async def _close(self) -> None:
        self._ws.close()
        await self._ws.wait_closed()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self._ws.sockets[0].getsockname()[1]}/ws/agent/"

    @property
    def site(self) -> Site:
        """Where agents find this site (HTTP and the socket are on two ports here)."""
        return Site(self.http_url, self.ws_url)

    # -- what tests do --------------------------------------------------------------------------------

    def send(self, device: str, msg: dict) -> None:
        asyncio.run_coroutine_threadsafe(self._sockets[device].send(json.dumps(msg)), self._loop).result(5)

    def drop_once(self, device: str, after: str) -> None:
        """Store the events message holding an `after` event without acking it, lose the next one, drop."""
        self._drop[device] = after

    def messages(self, device: str | None = None, kind: str | None = None) -> list[tuple[float, dict]]:
        with self.lock:
            return [
                (t, m)
                for t, d, m in self.received
                if (device is None or d == device) and (kind is None or m.get("type") == kind)
            ]

    def events(self, device: str, kind: str | None = None, job=None) -> list[dict]:
        """Stored events of `device` (all sessions), optionally of one type and job."""
        with self.lock:
            entries = [e for (d, _), stored in self.stored.items() if d == device for e in stored]
        return [
            e["event"]
            for e in entries
            if (kind is None or e["event"].get("type") == kind) and (job is None or e["job"] == job)
        ]

    def wait(self, predicate, timeout: float, what: str):
        """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    # -- the socket -----------------------------------------------------------------------------------

    def _credential(self, headers) -> str:
        return headers.get("Authorization", "").removeprefix("Bearer ").strip()

    def _check(self, connection, request):
        if request.path != "/ws/agent/":
            return connection.respond(HTTPStatus.NOT_FOUND, "no such socket\n")
        cred = self._credential(request.headers)
        if cred not in self.credentials and cred not in self.revoked:
            return connection.respond(HTTPStatus.FORBIDDEN, "unknown credential\n")
        return None

    async def _session(self, ws) -> None:
        cred = self._credential(ws.request.headers)
        if cred in self.revoked:
            await ws.close(4401, "credential revoked")
            return
        device = self.credentials[cred]
        self._sockets[device] = ws
        try:
            await self._messages(ws, device)
        except ConnectionClosed:
            pass  # the agent went away (stopped, or a test dropped it)

    async def _messages(self, ws, device: str) -> None:
        session = None
        async for raw in ws:
            received = time.monotonic()
            msg = json.loads(raw)
            if msg["type"] == "clock" and self.clock_offset is not None:
                t1, t2 = received + self.clock_offset, time.monotonic() + self.clock_offset
                await ws.send(json.dumps({"type": "clock", "t0": msg["t0"], "t1": t1, "t2": t2}))
            elif msg["type"] == "clock" and self.refuse_clock:
                reply = "unknown message type 'clock'; expected one of hello, heartbeat, accepted, events"
                await ws.send(json.dumps({"type": "error", "message": reply}))
            with self.lock:
                self.received.append((time.monotonic(), device, msg))
            if msg["type"] == "hello":
                session = msg["session"]
                with self.lock:
                    stored = self.stored.setdefault((device, session), [])
                    last = stored[-1]["seq"] if stored else 0
                welcome = {"type": "welcome", "device": device, "id": 1, "last_seq": last}
                for early in self.early.pop(device, []):  # as a site whose hello waits for its database may
                    await ws.send(json.dumps(early))
                await ws.send(json.dumps({**welcome, "heartbeat_s": self.heartbeat_s}))
            elif msg["type"] == "events":
                if not await self._events(ws, device, session, msg["events"]):
                    return

    async def _events(self, ws, device: str, session: str, entries: list[dict]) -> bool:
        """Store and ack `entries`, or play the drop; False when the connection was dropped."""
        trigger = self._drop.get(device)
        if trigger == "lose-next":
            del self._drop[device]
            with self.lock:
                self.lost = list(entries)
                self.dropped_at = time.monotonic()
            ws.transport.abort()  # no close frame: the agent sees a dead connection
            return False
        with self.lock:
            stored = self.stored[(device, session)]
            last = stored[-1]["seq"] if stored else 0
            stored.extend(e for e in entries if e["seq"] > last)
            last = stored[-1]["seq"] if stored else 0
        if trigger and any(e["event"]["type"] == trigger for e in entries):
            self._drop[device] = "lose-next"  # stored, not acknowledged: the welcome's last_seq must cover it
            return True
        if self.ack_delay_s:
            with self.lock:
                self.unacked += 1
                self.most_unacked = max(self.most_unacked, self.unacked)
            task = asyncio.ensure_future(self._ack_later(ws, last))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)
            return True
        await ws.send(json.dumps({"type": "ack", "seq": last}))
        return True

    async def _ack_later(self, ws, seq: int) -> None:
        await asyncio.sleep(self.ack_delay_s)
        with self.lock:
            self.unacked -= 1
        await ws.send(json.dumps({"type": "ack", "seq": seq}))


def _handler(site: FakeSite):
    class Handler(JsonHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            parts = self.path.strip("/").split("/")
            if self.path == "/api/agent/enroll/":
                token = json.loads(body).get("token")
                name = site.tokens.pop(token, None)
                if name is None:
                    return self.reply(403, {"error": "invalid or used enrollment token"})
                cred = next(c for c, n in site.credentials.items() if n == name)
                return self.reply(200, {"device": {"id": 1, "name": name, "kind": "jetson-nano"}, "credential": cred})
            if parts[:3] == ["api", "agent", "jobs"] and parts[4:] == ["part"]:
                device = site.credentials.get(self.headers.get("Authorization", "").removeprefix("Bearer "))
                if device is None or self.headers.get("Content-Type") != "application/octet-stream":
                    return self.reply(403, {"error": "bad credential or content type"})
                with site.lock:
                    site.parts[(parts[3], device)] = body
                return self.reply(200, {"ok": True})
            self.reply(404, {"error": "not found"})

    return Handler
