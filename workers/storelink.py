"""The authenticated path to a job's store: the site's gateway admits only the job's devices, their agents relay.

torch's TCPStore authenticates no one and lists its keys, so a job's store listens on the site's loopback only.
Boards reach it through one fixed port of the site (ASTEROID_STORE_PORT), the `Gateway`: a connection proves
it belongs to a job by answering a challenge with the job's secret, which the job's devices get only over their
agents' authenticated sockets (the coordinated `start` message); then its bytes are piped to the job's store.
On the board, the agent runs a `Relay` per run on its own loopback: the device process's store clients (torch's
own, which cannot authenticate) connect to it, and it opens an authenticated connection to the gateway for each.
It carries only connections of its own process tree (workers/peers.py): another local user's process is refused.

    gateway = Gateway("192.168.1.10", 8001, tls); gateway.start()   # the site's coordinators process
    secret = gateway.open(job_id, store_port)                        # the job's store on 127.0.0.1:store_port
    gateway.admit(job_id, serial)                                    # a board certificate of the job (TLS)
    relay = Relay("192.168.1.10", 8001, job_id, secret, tls); port = relay.start()   # the agent: 127.0.0.1:port
    relay.stop(); gateway.close(job_id); gateway.stop()

With `tls` (the site serves TLS: engine/tls.py) the connection is mutual TLS first: the gateway shows the site's
certificate, the board its own, and the gateway takes only a board certificate `admit`ted for the job, so the
store's bytes are encrypted and a byte injected on the path ends the connection. Without it (a site on loopback,
or one whose administrator chose plain HTTP) the secret's challenge alone guards the store.

Handshake, one line each way before any store byte: the gateway sends `ASTEROID-STORE 1 <nonce>`, the relay
answers `<job> <hmac-sha256(secret, nonce:job)>`, the gateway says `OK` (and pipes) or `DENIED` (and closes).
A sniffed answer is useless for another nonce. A host may hold PENDING_PER_HOST connections in their handshake
at once (HANDSHAKE_S each at most), so a flood of half-open connections from a stranger starves no job.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import ssl
import threading
import time

from engine.tls import peer_identity
from workers import peers

log = logging.getLogger("workers.storelink")

GREETING = b"ASTEROID-STORE 1 "
HANDSHAKE_S = 5.0  # a connection that has not proved itself by then (TLS and the answer) is closed
PENDING_PER_HOST = 32  # connections of one host in their handshake at once; more are closed unanswered
MAX_LINE = 256
REFUSAL_LOG_S = 10.0  # one warning per host this often for refusals beyond the first (a flood logs a few lines)
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
    """The site's end: admits a connection to job J's store only when it proves it knows J's secret (and, over
    TLS, shows a board certificate admitted for J)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None):
        super().__init__(host, port, "store-gateway")
        self.tls = tls
        self._jobs: dict[str, tuple[str, int]] = {}  # job -> (secret, the store's loopback port)
        self._boards: dict[str, set[str]] = {}  # job -> serials of the board certificates admitted (TLS)
        self._pending: dict[str, int] = {}  # host -> its connections in their handshake (the loop's thread only)
        self._said: dict[str, float] = {}  # host -> when a refusal of it was last logged
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

    def admit(self, job, serial: str) -> None:
        """Let the board whose certificate has serial `serial` (hex) into `job`'s store (with TLS)."""
        with self._lock:
            self._boards.setdefault(str(job), set()).add(serial.lower())

    def close(self, job) -> None:
        """No new connection to `job`'s store (those already piped end with the store)."""
        with self._lock:
            self._jobs.pop(str(job), None)
            self._boards.pop(str(job), None)

    def _refuse(self, peer, why: str, always: bool = True) -> None:
        host = str(peer[0]) if peer else "?"
        now = time.monotonic()
        if always or now - self._said.get(host, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._said[host] = now
            log.warning("store gateway: refused %s: %s", f"{host}:{peer[1]}" if peer else host, why)

    async def serve(self, reader, writer) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        if self._pending.get(host, 0) >= PENDING_PER_HOST:
            self._refuse(peer, f"more than {PENDING_PER_HOST} connections of it in their handshake", always=False)
            writer.transport.abort()
            return
        self._pending[host] = self._pending.get(host, 0) + 1
        try:
            proved = await self._handshake(reader, writer, peer)
        finally:
            self._pending[host] -= 1
            if not self._pending[host]:
                del self._pending[host]
        if proved is None:
            return
        store = await asyncio.open_connection("127.0.0.1", proved)
        self.track(store[1])
        writer.write(b"OK\n")
        await writer.drain()
        try:
            await _splice((reader, writer), store)
        finally:
            self._writers.discard(store[1])

    async def _handshake(self, reader, writer, peer) -> int | None:
        """The store port a connection proved it may reach, or None (refused, with one warning line)."""
        nonce = secrets.token_hex(16)
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                if self.tls is not None:
                    await writer.start_tls(self.tls)
                writer.write(GREETING + nonce.encode() + b"\n")
                await writer.drain()
                line = await reader.readline()
        except TimeoutError:
            self._refuse(peer, f"no handshake within {HANDSHAKE_S:.0f} s", always=False)
            return None
        except ssl.SSLError as exc:
            self._refuse(peer, f"TLS handshake failed ({exc.reason or exc})", always=False)
            return None
        job, why, port = self._check(line, nonce, writer.get_extra_info("ssl_object"))
        if why:
            self._refuse(peer, f"job {job[:20]!r}: {why}" if job else why)
            writer.write(b"DENIED\n")
            await writer.drain()
            return None
        return port

    def _check(self, line: bytes, nonce: str, ssl_object) -> tuple[str, str, int]:
        """(job, "", its store's port) for an answer that proves the job, else (job or "", why not, 0)."""
        if not line.endswith(b"\n") or len(line) > MAX_LINE:
            return "", "no answer line" if not line else "an answer line too long", 0
        try:
            text = line.decode("ascii").strip()
        except UnicodeDecodeError:
            return "", "an answer that is not ASCII", 0
        job, _, given = text.partition(" ")
        if not job.isdigit() or len(given) != 64 or any(c not in "0123456789abcdef" for c in given):
            return job if job.isdigit() else "", "a malformed answer (want: JOB HMAC-HEX)", 0
        with self._lock:
            known, boards = self._jobs.get(job), self._boards.get(job, set())
        if known is None:
            return job, "unknown job", 0
        if not hmac.compare_digest(given, answer(known[0], nonce, job)):
            return job, "wrong secret", 0
        if self.tls is not None:
            identity = peer_identity(ssl_object)
            if identity is None or identity[1] not in boards:
                return job, "its board certificate is not one of the job's", 0
        return job, "", known[1]


class Relay(_Server):
    """The board's end, one per run: its device process's store clients connect to 127.0.0.1:`port`, each is
    carried to the site's gateway over a connection of its own that answers the challenge with the job's secret.
    It serves only connections from process `root` (default: this one) and its descendants."""

    def __init__(self, gateway_host: str, gateway_port: int, job, secret: str, tls: ssl.SSLContext | None = None,
                 root: int | None = None):  # fmt: skip
        super().__init__("127.0.0.1", 0, f"store-relay-{job}")
        self.gateway = (gateway_host, gateway_port)
        self.job, self.secret, self.tls, self.root = job, secret, tls, root

    async def serve(self, reader, writer) -> None:
        peer, here = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        if not peers.from_descendant(peer, here, self.root):
            log.warning("job %s: the store relay refused %s:%s: not this agent's device process", self.job, *peer[:2])
            return
        try:
            upstream = await asyncio.wait_for(connect(*self.gateway, self.job, self.secret, self.tls), HANDSHAKE_S * 2)
        except (OSError, asyncio.TimeoutError) as exc:  # noqa: UP041 (on Python 3.10, a board's, not the builtin)
            log.warning("job %s: cannot reach the site's store gateway %s:%s: %s", self.job, *self.gateway, exc)
            return
        self.track(upstream[1])
        try:
            await _splice((reader, writer), upstream)
        finally:
            self._writers.discard(upstream[1])


async def connect(host: str, port: int, job, secret: str, tls: ssl.SSLContext | None = None) -> tuple:
    """An authenticated connection to job `job`'s store through the gateway at host:port (reader, writer); over
    TLS with `tls` (the site's CA, the board's certificate)."""
    # TLS from the connect (not StreamWriter.start_tls, new in Python 3.11: a board may run 3.10, JetPack 6's)
    reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None)
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
