"""The job socket `/ws/jobs/<id>/`: the owner (or staff) gets a snapshot, then every update of the job."""

from __future__ import annotations

from autobahn.exception import Disconnected  # daphne's WebSocket layer: a send after the client closed
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.jobs.live import snapshot
from webapp.jobs.models import Job
from webapp.lib.dispatch import DirectDispatch

# Close codes of a refused socket (static/js/live.js stops reconnecting on them and says why).
NOT_LOGGED_IN = 4401  # no session and no valid API token
NOT_FOUND = 4404  # no such job, or another user's (the same answer, as on the pages and the API)
TAKES_NO_MESSAGES = "this socket only sends the job's updates; act on the job through the page or the API"


@database_sync_to_async
def _visible_snapshot(user, job_id: int) -> dict | None:
    jobs = Job.objects.all() if user.is_staff else Job.objects.filter(owner=user)
    job = jobs.filter(pk=job_id).first()
    return snapshot(job) if job else None


class JobConsumer(DirectDispatch, AsyncJsonWebsocketConsumer):
    async def connect(self):
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        self.group = f"job.{job_id}"
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
        try:
            await self.send_json(event["message"])
        except Disconnected:  # the watcher left while updates were queued for it: nobody to tell
            pass
