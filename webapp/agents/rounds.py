"""Agents' event batches and heartbeats stored in rounds: every batch waiting in this process goes to the
database in one transaction (webapp.jobs.ingest.record_round), every heartbeat in one statement
(webapp.devices.liveness.store_heard), and the watchers' frames are sent from the event loop.

Storing each socket's batch on its own cost a transaction and, per job it touched, a hop from the database
thread back to the event loop to send its watchers a frame; each heartbeat cost a read and a write. With
hundreds of agents streaming, that kept daphne's one database thread busy, and every agent's `hello` and
`accepted` waited behind it. A round takes what came in by the time that thread is free for it (at most `ROUND`
batches, so the thread's other work waits for one round at most), answers each message once the round is
committed, and sends each job's watchers one frame for the round.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from webapp.devices import health
from webapp.devices.liveness import store_heard
from webapp.devices.models import Device
from webapp.jobs import eventstream
from webapp.jobs.ingest import record_round

log = logging.getLogger(__name__)

ROUND = 64  # batches stored per transaction at most


class Rounds:
    """One event loop's queue of agents' messages waiting for the database (`events` and `heartbeat`), and the
    task that stores them, a round at a time."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[Device, dict, asyncio.Future]] = deque()
        self.task: asyncio.Task | None = None

    async def record(self, device: Device, msg: dict) -> int | None:
        """Store an agent's `events` message (returns the seq to acknowledge) or note its `heartbeat` (returns
        None) in the next round; raises what storing it raised."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((device, msg, future))
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self.waiting:
            taken, results, frames = await _store_round(self.waiting)
            for (_, _, future), result in zip(taken, results, strict=True):
                if future.done():  # its socket closed meanwhile
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            await _send(frames)


@database_sync_to_async
def _store_round(waiting: deque) -> tuple[list, list, list]:
    """In the database thread: take what is waiting once that thread is free (all that came in meanwhile, up to
    `ROUND` batches, and the heartbeats among them, noted in one statement) and store it. Returns what it took,
    each message's outcome, and the watchers' frames."""
    beats, taken = [], []
    while waiting and len(taken) < ROUND:
        item = waiting.popleft()  # (a deque: appended to by the event loop's thread meanwhile)
        if item[1]["type"] == "heartbeat":
            beats.append(item)
        elif not item[2].done():  # (a socket closed meanwhile: nobody to acknowledge)
            taken.append(item)
    try:
        store_heard([device.pk for device, _, _ in beats])
        noted = [None] * len(beats)
    except Exception as exc:
        noted = [exc] * len(beats)
    try:  # each board's CPU, memory, GPU, ... over time: a sample lost (a job deleted meanwhile) costs no heartbeat
        health.store([(device, msg) for device, msg, _ in beats])
    except Exception as exc:
        log.warning("could not store %d devices' health samples: %s", len(beats), exc)
    results, frames = [], []
    try:
        if taken:
            results, frames = record_round([(device, msg["events"], msg["last_seq"]) for device, msg, _ in taken])
        else:  # heartbeats alone: events stored while Redis was down may still be held for their streams
            eventstream.flush()
    except Exception as exc:  # the round did not commit: each agent is told by its socket's close, and resends
        results, frames = [exc] * len(taken), []
    return beats + taken, noted + results, frames


async def _send(frames: list[tuple[str, dict]]) -> None:
    layer = get_channel_layer()
    if layer is None or not frames:
        return
    sent = await asyncio.gather(
        *(layer.group_send(group, {"type": "job.message", "message": m}) for group, m in frames),
        return_exceptions=True,
    )
    for (group, _), outcome in zip(frames, sent, strict=True):
        if isinstance(outcome, Exception):  # stored and acknowledged: the page reads it back when it reconnects
            log.warning("could not relay a round of events to %s: %s", group, outcome)


_rounds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Rounds] = weakref.WeakKeyDictionary()


def rounds() -> Rounds:
    """This event loop's rounds (daphne runs one loop; tests run several, one after another)."""
    loop = asyncio.get_running_loop()
    if loop not in _rounds:
        _rounds[loop] = Rounds()
    return _rounds[loop]
