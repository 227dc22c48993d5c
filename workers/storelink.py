"""The authenticated path to a job's store: the site's gateway admits only the job's devices, their agents relay.

torch's TCPStore authenticates no one and lists its keys, so a job's store listens on the site's loopback only.
Boards reach it through one fixed port of the site (ASTEROID_STORE_PORT), the `Gateway`: a connection proves
it belongs to a job by answering a challenge with the job's secret, which the job's devices get only over their
agents' authenticated sockets (the coordinated `start` message); then its bytes are piped to the job's store.
On the board, the agent runs a `Relay` per run on its own loopback: the device process's store clients (torch's
own, which cannot authenticate) connect to it, and it opens an authenticated connection to the gateway for each.

    gateway = Gateway("192.168.1.10", 8001); gateway.start()    # the site's coordinators process
    secret = gateway.open(job_id, store_port)                   # the job's store on 127.0.0.1:store_port
    relay = Relay("192.168.1.10", 8001, job_id, secret); port = relay.start()   # the agent: 127.0.0.1:port
    relay.stop(); gateway.close(job_id); gateway.stop()

Handshake, one line each way before any store byte: the gateway sends `ASTEROID-STORE 1 <nonce>`, the relay
answers `<job> <hmac-sha256(secret, nonce:job)>`, the gateway says `OK` (and pipes) or `DENIED` (and closes).
The secret never crosses the LAN; a sniffed answer is useless for another nonce. What follows is plaintext, as
the data plane's gloo traffic is (docs/deployment.md says what a lab should do about that).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading

log = logging.getLogger("workers.storelink")

GREETING = b"ASTEROID-STORE 1 "
HANDSHAKE_S = 10.0  # a connection that has not proved itself by then is closed
MAX_LINE = 256
CHUNK = 64 * 1024


class StoreLinkError(OSError):
    """The gateway refused the relay (wrong secret, unknown job) or did not speak the protocol."""


def answer(secret: str, nonce: str, job) -> str:
    return hmac.new(secret.encode(), f"{nonce}:{job}".encode(), hashlib.sha256).hexdigest()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _splice(a: tuple, b: tuple) -> None:
    """Pipe two connections into each other until either side closes."""
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]), return_exceptions=True)


class _Server:
    """An asyncio TCP server on a thread of its own, started and stopped from any thread."""

    def __init__(self, host: str, port: int, name: str):
        self.host, self.port, self.name = host, port, name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> int:
        """Listen; the port it listens on. Raises OSError when the address cannot be bound."""
        ready: dict = {}
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, self.port))
                ready["port"] = self._server.sockets[0].getsockname()[1]
            except OSError as exc:
                ready["error"] = exc
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        started.wait()
        if "error" in ready:
            raise ready["error"]
        self.port = ready["port"]
        return self.port

    async def _accept(self, reader, writer) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self.serve(reader, writer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:  # stopping; ending quietly (Python 3.11's streams log a cancelled handler)
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    def track(self, writer: asyncio.StreamWriter) -> asyncio.StreamWriter:
        """Keep `writer` to be closed when the server stops (an upstream connection of a piped one)."""
        self._writers.add(writer)
        return writer

    async def serve(self, reader, writer) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop)
        except RuntimeError:  # the loop closed in between
            return
        if self._thread is not None:
            self._thread.join(5)


class Gateway(_Server):
    """The site's end: admits a connection to job J's store only when it proves it knows J's secret."""

    def __init__(self, host: str, port: int):
        super().__init__(host, port, "store-gateway")
        self._jobs: dict[str, tuple[str, int]] = {}  # job -> (secret, the store's loopback port)
        self._lock = threading.Lock()

    def open(self, job, store_port: int) -> str:
        """Admit job `job`'s devices to its store on 127.0.0.1:`store_port`; the job's secret (the same one again
        while the store is the same)."""
        with self._lock:
            known = self._jobs.get(str(job))
            if known is not None and known[1] == store_port:
                return known[0]
            secret = secrets.token_hex(32)
            self._jobs[str(job)] = (secret, store_port)
            return secret

    def close(self, job) -> None:
        """No new connection to `job`'s store (those already piped end with the store)."""
        with self._lock:
            self._jobs.pop(str(job), None)

    async def serve(self, reader, writer) -> None:
        nonce = secrets.token_hex(16)
        writer.write(GREETING + nonce.encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), HANDSHAKE_S)
        job, _, given = line[:MAX_LINE].decode("ascii", "replace").strip().partition(" ")
        with self._lock:
            known = self._jobs.get(job)
        if known is None or not hmac.compare_digest(given, answer(known[0], nonce, job)):
            peer = writer.get_extra_info("peername")
            log.warning("store gateway: refused %s (job %r: %s)", peer, job[:20], "unknown" if known is None else
                        "wrong secret")  # fmt: skip
            writer.write(b"DENIED\n")
            await writer.drain()
            return
        store = await asyncio.open_connection("127.0.0.1", known[1])
        self.track(store[1])
        writer.write(b"OK\n")
        await writer.drain()
        try:
            await _splice((reader, writer), store)
        finally:
            self._writers.discard(store[1])


class Relay(_Server):
    """The board's end, one per run: its device process's store clients connect to 127.0.0.1:`port`, each is
    carried to the site's gateway over a connection of its own that answers the challenge with the job's secret."""

    def __init__(self, gateway_host: str, gateway_port: int, job, secret: str):
        super().__init__("127.0.0.1", 0, f"store-relay-{job}")
        self.gateway = (gateway_host, gateway_port)
        self.job, self.secret = job, secret

    async def serve(self, reader, writer) -> None:
        try:
            upstream = await asyncio.wait_for(connect(*self.gateway, self.job, self.secret), HANDSHAKE_S)
        except (OSError, TimeoutError) as exc:
            log.warning("job %s: cannot reach the site's store gateway %s:%s: %s", self.job, *self.gateway, exc)
            return
        self.track(upstream[1])
        try:
            await _splice((reader, writer), upstream)
        finally:
            self._writers.discard(upstream[1])


async def connect(host: str, port: int, job, secret: str) -> tuple:
    """An authenticated connection to job `job`'s store through the gateway at host:port (reader, writer)."""
    reader, writer = await asyncio.open_connection(host, port)
    greeting = await reader.readline()
    if not greeting.startswith(GREETING):
        writer.close()
        raise StoreLinkError(f"{host}:{port} is not an Asteroid store gateway")
    nonce = greeting[len(GREETING) :].decode("ascii", "replace").strip()
    writer.write(f"{job} {answer(secret, nonce, job)}\n".encode())
    await writer.drain()
    if (await reader.readline()).strip() != b"OK":
        writer.close()
        raise StoreLinkError(f"the store gateway at {host}:{port} refused job {job}'s secret")
    return reader, writer
