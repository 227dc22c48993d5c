"""Device events on their way to their job's coordinator: one Redis stream per job, read in order, each event once.

    publish([(job_id, device, session, seq, event), ...])     # the site, once it has stored an agent's batch
    reader = Reader(job_id)                                   # a coordinator, when it starts (or takes over)
    for entry, device, event in reader.read(timeout=0.05): ...  # blocks on the stream (XREAD BLOCK), no polling

The site adds an agent's batch to the stream once the batch is committed to the database (the coordinator reads
what the database has) and before it acknowledges it. While Redis cannot be reached (restarting: `make run`
starts its embedded one again), what the site stored waits in its process and goes first when Redis is back,
and a coordinator's read finds nothing until then: its devices' events reach it late, in order, never twice.
A reader starts at the stream's end: what an earlier coordinator of the job was sent is not for it (its
device processes are started again from the job's central replica), everything after reaches it in order,
whichever site process stored it and whichever coordinators process reads it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from webapp.lib.outage import UNREACHABLE, Outage

log = logging.getLogger(__name__)

# What a coordinator reads of its devices' events: what it acts on (a held-out score past chance's is a divergence,
# engine.recipe), and the steps' measured compute (for drift); the rest (traces) only the site keeps.
FOR_COORDINATOR = ("device-start", "iteration", "eval", "device-done", "device-error", "job-stopped", "restore", "step")
KEEP = 50_000  # entries kept per job (approximately: trimmed as Redis finds convenient), ~ hours of steps
TTL_S = 7 * 24 * 3600  # a stream nobody adds to for a week goes (the job ended long ago)
BATCH = 1000  # entries read at most per call
HELD_MAX = 500_000  # entries a site process holds while Redis is down (minutes of a large lab's events), then drops
RETRY_S = 0.5  # how long a read waits before it tries an unreachable Redis again

_held: deque[tuple[int, str, str, int, dict]] = deque()  # stored, not yet on their stream (Redis down), oldest first
_held_lock = threading.Lock()
_publishing = Outage(log, "Redis for the coordinators' event streams",
                     "the devices' events wait in this process (they are stored) and go when it is back")  # fmt: skip
_reading = Outage(log, "Redis for the coordinators' event streams", "coordinators wait for their devices' events")

_client: redis.Redis | None = None
_client_lock = threading.Lock()


def client() -> redis.Redis:
    """This process's Redis client for the streams (thread-safe: a connection pool), made at first use."""
    global _client
    with _client_lock:
        if _client is None:
            if not settings.REDIS_URL:
                raise ImproperlyConfigured(
                    "device events reach their job's coordinator through Redis: set REDIS_URL (`make run` starts an "
                    "embedded one)"
                )
            _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30, health_check_interval=30)
        return _client


def stream_key(job_id: int) -> str:
    """The job's stream, named after the site's database too: sites sharing one Redis never share a stream."""
    database = settings.DATABASES["default"]
    site = f"{database.get('HOST') or ''}:{database.get('PORT') or ''}/{database['NAME']}"
    return f"asteroid:{site}:job:{job_id}:device-events"


def publish(entries: Iterable[tuple[int, str, str, int, dict]]) -> bool:
    """Append (job id, device, its agent's session, the event's seq, event) to each job's stream, in order, after
    any this process holds; False while Redis cannot be reached: then they are held for the next call (`flush`)."""
    with _held_lock:
        _held.extend(entries)
        if not _held:
            return True
        try:
            _append(list(_held))
        except UNREACHABLE as exc:
            _publishing.failed(exc)
            if len(_held) > HELD_MAX:
                dropped = len(_held) - HELD_MAX
                for _ in range(dropped):
                    _held.popleft()
                log.error("Redis has been unreachable too long: %d device events dropped before their coordinators "
                          "read them (they are stored)", dropped)  # fmt: skip
            return False
        _held.clear()
        _publishing.reached()
        return True


def flush() -> bool:
    """Publish what this process holds (a site process calls it now and then: there may be no new batch)."""
    return publish(())


def _append(entries: list[tuple[int, str, str, int, dict]]) -> None:
    pipe = client().pipeline(transaction=False)
    for job_id, device, session, seq, event in entries:
        fields = {"device": device, "session": session, "seq": seq, "event": json.dumps(event)}
        pipe.xadd(stream_key(job_id), fields, maxlen=KEEP, approximate=True)
    for job_id in {e[0] for e in entries}:
        pipe.expire(stream_key(job_id), TTL_S)
    pipe.execute()


def forget(job_id: int) -> None:
    """Delete a job's stream (its run is over)."""
    client().delete(stream_key(job_id))


class Reader:
    """One coordinator's reading of its job's stream: from where the stream ends when it is made, in order, each
    (agent session, seq) once."""

    def __init__(self, job_id: int) -> None:
        self.key = stream_key(job_id)
        newest = client().xrevrange(self.key, count=1)
        self.last: Any = newest[0][0] if newest else b"0-0"
        self.seqs: dict[tuple[str, str], int] = {}  # (device, session) -> the highest seq read

    def read(self, timeout: float) -> list[tuple[bytes, str, dict]]:
        """The events added since the last read, as (entry id, device, event); waits up to `timeout` s for the
        first. (An entry id is "<Redis's clock at the add, ms>-<n>".)"""
        block = int(timeout * 1000)
        try:
            reply = client().xread({self.key: self.last}, count=BATCH, block=block if block > 0 else None)
        except UNREACHABLE as exc:  # down or restarting: nothing yet (what was stored meanwhile is held for it)
            _reading.failed(exc)
            time.sleep(min(timeout, RETRY_S))
            return []
        _reading.reached()
        out = []
        for _key, entries in reply or ():
            for entry_id, fields in entries:
                self.last = entry_id
                device, session = fields[b"device"].decode(), fields[b"session"].decode()
                seq = int(fields[b"seq"])
                if seq <= self.seqs.get((device, session), 0):
                    continue  # added again after its batch failed to commit: read already
                self.seqs[(device, session)] = seq
                out.append((entry_id, device, json.loads(fields[b"event"])))
        return out
