"""The benchmark's board: the real agent's session and outbox, driving a runner that starts no device process."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque

from engine.errors import UserError
from engine.events import DeviceError, JobStopped
from workers.connection import Connection
from workers.device import free_port
from workers.outbox import Outbox
from workers.site import Site
from workers.sitebench import CLOSE_TIMEOUT_S, CONNECT_TIMEOUT_S, DEVICE_KIND, BenchError

POLL_S = 0.02  # how often the benchmark looks at what the connection's thread-safe state says


class TimedOutbox(Outbox):
    """The agent's outbox, noting when each event is added (its send time) and how long until the site acks it."""

    def __init__(self) -> None:
        super().__init__()
        self.acked = 0  # the highest seq the site acknowledged
        self.acks: list[int] = []  # the seq of each ack that acknowledged something new: one per `events` message
        self.ack_s: list[tuple[int, float]] = []  # (seq, add -> ack in seconds) of each acknowledged event, in order
        self._added: deque[tuple[int, float]] = deque()  # (seq, time added) of events not yet acknowledged
        self._times = threading.Lock()

    def add(self, job, event: dict) -> int | None:
        with self._times:  # in order with the seq, also when a connection's thread adds (job-stopped)
            now = time.monotonic()
            seq = super().add(job, event)
            if seq is not None:
                self._added.append((seq, now))
        return seq

    def ack(self, seq: int) -> None:
        now = time.monotonic()
        super().ack(seq)
        with self._times:
            if seq > self.acked:
                self.acked = seq
                self.acks.append(seq)
            while self._added and self._added[0][0] <= seq:
                added, at = self._added.popleft()
                self.ack_s.append((added, now - at))


class BenchRunner:
    """What `Connection` drives (workers/device.py `Runner`'s interface): takes the benchmark's one job, runs
    nothing, answers `cancel` with `job-stopped`, and refuses anything else."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.device = ""  # the site's name for this device (the connection sets it from `welcome`)
        self.address = ""
        self.clock = None  # the connection's ClockSync (unused: no device process takes its times)
        self.expected: int | None = None  # the job whose `assign` it will accept (set once the job is planned)
        self.accepted: int | None = None  # the job it accepted
        self.started = threading.Event()  # its `start` came
        self.cancelled = threading.Event()  # its `cancel` came and `job-stopped` is in the outbox
        self.stopped_seq = 0  # the seq of that `job-stopped`
        self.unexpected: list[str] = []  # what the site asked that the benchmark did not expect
        self._job = None  # the job it runs: accepted and not yet cancelled
        self._port: int | None = None
        self._lock = threading.Lock()

    @property
    def job(self):
        return self._job

    @property
    def state(self) -> str:
        return "idle" if self._job is None else "busy"

    def assign(self, msg: dict) -> dict:
        job = msg.get("job")
        with self._lock:
            if job is not None and job == self._job:  # the site asked again (our reply was lost in a reconnect)
                return {"type": "accepted", "job": job, "port": self._port}
            if job != self.expected or self.accepted is not None:
                self.unexpected.append(f"assign of job {job}")
                raise UserError(f"this benchmark's device takes only job {self.expected}, not job {job}")
            self._job = self.accepted = job
            self._port = free_port() if msg.get("rank") == 0 else None
            return {"type": "accepted", "job": job, "port": self._port}

    def start(self, msg: dict) -> None:
        if msg.get("job") is None or msg.get("job") != self._job:
            self.unexpected.append(f"start of job {msg.get('job')}")
            raise UserError(f"job {msg.get('job')} was not assigned to this benchmark's device")
        self.started.set()

    def cancel(self, job) -> None:
        with self._lock:
            seq = self.outbox.add(job, JobStopped(self.device, "cancelled").to_message())
            if job is None or job != self._job:
                return
            self._job, self.stopped_seq = None, seq or 0
        self.cancelled.set()

    def kill(self, job) -> None:
        self.unexpected.append(f"kill of job {job}")
        raise UserError(f"job {job} has no device process here (this is a benchmark's device)")

    def refuse(self, job, message: str, own: bool = True) -> None:
        """As workers/device.py's Runner says it cannot take part: `device-error` (its own), `job-stopped`."""
        if own:
            self.outbox.add(job, DeviceError(self.device, -1, message).to_message())
        self.outbox.add(job, JobStopped(self.device, "rejected", "" if own else message).to_message())

    def shutdown(self) -> None:
        with self._lock:
            job, self._job = self._job, None
        if job is not None:
            self.outbox.add(job, JobStopped(self.device, "agent-stopped").to_message())


class _Warnings(logging.Handler):
    """The connection's warnings (the site's `error` replies, refusals), kept for the report instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class BenchAgent:
    """The benchmark's device agent: a real `Connection` with a TimedOutbox and a BenchRunner, on this loop."""

    def __init__(self, site: Site, credential: str):
        self.outbox = TimedOutbox()
        self.runner = BenchRunner(self.outbox)
        self.connection = Connection(site, credential, self._hello, self.outbox, self.runner)
        self.session = secrets.token_hex(8)  # one per benchmark run, kept across reconnects (seqs go on)
        self.sessions = 0  # hellos said: more than one means the connection was lost and made again
        self.hellos: list[float] = []  # when each hello went (monotonic): the session was made (again)
        self.warnings = _Warnings()
        self._logger = logging.getLogger("workers.connection")
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.connection.device or ""

    async def _hello(self) -> dict:
        self.sessions += 1
        self.hellos.append(time.monotonic())
        return {
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

    async def start(self) -> None:
        """Serve the connection on this loop; returns once the site welcomed it, or raises a BenchError."""
        self._logger.addHandler(self.warnings)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.connection.run(self._stop))
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not self.connection.connected.is_set():
            self.check_alive()
            if time.monotonic() > deadline:
                why = self.warnings.lines[-1] if self.warnings.lines else "no welcome"
                raise BenchError(f"the agent could not start a session within {CONNECT_TIMEOUT_S:.0f} s ({why})")
            await asyncio.sleep(POLL_S)

    def check_alive(self) -> None:
        """A BenchError when the connection gave up (a refused credential): lost sockets are made again."""
        if self._task is not None and self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            raise BenchError(f"the agent's connection ended: {exc or 'stopped'}")

    async def until(self, event: threading.Event, timeout: float) -> bool:
        """Whether `event` (the runner's) is set within `timeout` s, while the connection is alive."""
        deadline = time.monotonic() + timeout
        while not event.is_set():
            self.check_alive()
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def until_acked(self, seq: int, timeout: float) -> bool:
        """Whether the site acknowledged every event up to `seq` within `timeout` s."""
        deadline = time.monotonic() + timeout
        while self.outbox.acked < seq:
            if time.monotonic() > deadline or (self._task is not None and self._task.done()):
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def close(self) -> None:
        """Stop the connection (it says goodbye and sends what is left, briefly) and wait for it."""
        if self._task is not None and self._stop is not None:
            self._stop.set()
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S + 5)
            if not done:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # how it ended: check_alive said, if it mattered
        self._logger.removeHandler(self.warnings)
