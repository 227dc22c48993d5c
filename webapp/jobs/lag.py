"""How far behind a coordinators process runs: its watch loop's lateness and its devices' events' age when read.

    lag.event(entry_id)       # a coordinator read a stream entry: its age (Redis's clock at XADD -> this host now)
    lag.loop(late_s)          # the watch loop woke `late_s` later than it asked to
    lag.publish(owner)        # every PUBLISH_S: percentiles since the last, in Redis (read by `workers.sitebench`)
    lag.read()                # every live coordinators process's latest figures, by owner

The figures are in a Redis hash per site (`eventstream.stream_key`'s namespace), each process's entry expiring
when it stops publishing.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np

from webapp.jobs import eventstream
from webapp.lib.outage import UNREACHABLE, Outage

PUBLISH_S = 5.0
_outage = Outage(logging.getLogger(__name__), "Redis for the coordinators' lag figures", "they are not published")
_lock = threading.Lock()
_events: list[float] = []
_loops: list[float] = []
_published = 0.0


def event(entry_id: bytes | str) -> None:
    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-", 1)[0])
    with _lock:
        _events.append(max(0.0, time.time() * 1000 - ms))


def loop(late_s: float) -> None:
    with _lock:
        _loops.append(max(0.0, late_s * 1000))


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    a = np.asarray(values)
    return {"count": len(values), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}  # fmt: skip


def _key() -> str:
    return eventstream.stream_key(0).rsplit(":job:", 1)[0] + ":coordinators-lag"


def publish(owner: str, jobs: int, force: bool = False) -> None:
    """This process's figures since it last published (at most every PUBLISH_S unless `force`)."""
    global _published
    now = time.monotonic()
    if not force and now - _published < PUBLISH_S:
        return
    _published = now
    with _lock:
        events, loops = _events[:], _loops[:]
        _events.clear()
        _loops.clear()
    doc = {"jobs": jobs, "time": time.time(), "event_ms": _summary(events), "loop_ms": _summary(loops)}
    pipe = eventstream.client().pipeline(transaction=False)
    pipe.hset(_key(), owner, json.dumps(doc))
    pipe.expire(_key(), int(PUBLISH_S * 6))
    try:
        pipe.execute()
    except UNREACHABLE as exc:  # figures only: these are lost, the next go when it is back
        _outage.failed(exc)
        return
    _outage.reached()


def read() -> dict[str, dict]:
    """The latest figures of every coordinators process that published in the last 3 x PUBLISH_S."""
    now = time.time()
    docs = {k.decode(): json.loads(v) for k, v in eventstream.client().hgetall(_key()).items()}
    return {owner: doc for owner, doc in docs.items() if now - doc.get("time", 0) < 3 * PUBLISH_S}
