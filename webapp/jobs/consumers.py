"""The job socket `/ws/jobs/<id>/`: the owner (or staff) gets a snapshot, then every update of the job.

Every iteration, even one the channel layer dropped: channels_redis silently drops what it is sent for a socket whose
channel is full (a browser that fell behind a busy site) or that waited past its expiry. Iterations are numbered, so
a socket that is relayed iteration n after n - 3 reads n - 2 and n - 1 back from the database and sends them first,
and one told that the job ended sends the iterations after the newest it sent (the last ones have no next to show
that they were dropped).
"""

from __future__ import annotations

from autobahn.exception import Disconnected  # daphne's WebSocket layer: a send after the client closed
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.jobs.live import readable, snapshot
from webapp.jobs.models import Job, JobEvent
from webapp.lib.dispatch import DirectDispatch
from webapp.lib.outage import SocketOutage
from webapp.lib.pooled import off_the_database_thread

# Close codes of a refused socket (static/js/live.js stops reconnecting on them and says why).
NOT_LOGGED_IN = 4401  # no session and no valid API token
NOT_FOUND = 4404  # no such job, or another user's (the same answer, as on the pages and the API)
TAKES_NO_MESSAGES = "this socket only sends the job's updates; act on the job through the page or the API"
BACKFILL_MAX = 2000  # iterations read back for one gap (the newest of it, if it is longer)
END = 2**62  # above every iteration number


@database_sync_to_async
def _visible_snapshot(user, job_id: int) -> dict | None:
    jobs = Job.objects.all() if user.is_staff else Job.objects.filter(owner=user)
    job = jobs.filter(pk=job_id).first()
    return snapshot(job) if job else None


def _iterations_between(job_id: int, after: int, before: int) -> list[dict]:
    """The stored iterations numbered after < n < before, in order (a number trained twice, after a rollback: its
    latest), as browsers get them."""
    rows = JobEvent.objects.filter(
        job_id=job_id, type="iteration", data__iteration__gt=after, data__iteration__lt=before
    ).order_by("-id")
    latest: dict[int, dict] = {}
    for message in readable(rows.values_list("data", flat=True)[:BACKFILL_MAX]):
        latest.setdefault(message["iteration"], message)
    return [latest[n] for n in sorted(latest)]


# Off daphne's one database thread, where every agent's stored batches queue: a gap is filled while they wait.
_missed = off_the_database_thread(_iterations_between)


def _numbers(message: dict) -> list[int | None]:
    """The iteration numbers a relayed message carries, in order, and None where it says the job ended."""
    out = []
    for m in message.get("messages", ()) if message.get("type") == "batch" else (message,):
        if m.get("type") == "iteration" and type(m.get("iteration")) is int:
            out.append(m["iteration"])
        elif m.get("type") == "status" and m.get("status") in Job.FINISHED:
            out.append(None)
    return out


class JobConsumer(SocketOutage, DirectDispatch, AsyncJsonWebsocketConsumer):
    async def connect(self):
        self.job_id = job_id = self.scope["url_route"]["kwargs"]["job_id"]
        self.group = f"job.{job_id}"
        self.newest = -1  # the newest iteration number sent (set from the snapshot)
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return await self._refuse(NOT_LOGGED_IN)
        # Join first, then read the snapshot: an update in between arrives twice, never not at all
        # (the page de-duplicates iterations by number).
        await self.channel_layer.group_add(self.group, self.channel_name)
        first = await _visible_snapshot(user, job_id)
        if first is None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            return await self._refuse(NOT_FOUND)
        await self.accept()
        await self.send_json(first)
        # A later iteration more than one above the newest sent means some were dropped on the way.
        numbers = [m["iteration"] for m in first["iterations"] if type(m.get("iteration")) is int]
        self.newest = numbers[-1] if numbers else -1

    async def _refuse(self, code: int) -> None:
        # Accept, then close with the code: a close before accepting is an HTTP 403 to the handshake, and a
        # browser shows its page only 1006, which cannot be told from a dropped connection (it would retry forever).
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code):
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        # Not decoded at all: malformed JSON (or a binary frame) would raise in the JSON consumer and close with 1011.
        await self.send_json({"type": "error", "message": TAKES_NO_MESSAGES})

    async def job_message(self, event):
        message = event["message"]
        missed = []
        for n in _numbers(message):
            if n is None:  # the job ended: whatever it stored after the newest sent
                missed += await _missed(self.job_id, self.newest, END)
                self.newest = max([self.newest] + [m["iteration"] for m in missed])
                continue
            if n > self.newest + 1:  # (below it: a rollback's replay, or a duplicate of the snapshot's)
                missed += await _missed(self.job_id, self.newest, n)
            self.newest = n
        try:
            if missed:
                await self.send_json({"type": "batch", "messages": missed})
            await self.send_json(message)
        except Disconnected:  # the watcher left while updates were queued for it: nobody to tell
            pass
