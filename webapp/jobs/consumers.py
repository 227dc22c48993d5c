"""The job socket `/ws/jobs/<id>/`: the owner (or staff) gets a snapshot, then every update of the job."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.jobs.live import snapshot
from webapp.jobs.models import Job

NOT_FOUND = 4404


@database_sync_to_async
def _visible_snapshot(user, job_id: int) -> dict | None:
    if not user.is_authenticated:
        return None
    jobs = Job.objects.all() if user.is_staff else Job.objects.filter(owner=user)
    job = jobs.filter(pk=job_id).first()
    return snapshot(job) if job else None


class JobConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        self.group = f"job.{job_id}"
        # Join first, then read the snapshot: an update in between arrives twice, never not at all
        # (the page de-duplicates iterations by number).
        await self.channel_layer.group_add(self.group, self.channel_name)
        first = await _visible_snapshot(self.scope.get("user"), job_id)
        if first is None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            await self.close(code=NOT_FOUND)
            return
        await self.accept()
        await self.send_json(first)

    async def disconnect(self, code):
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        pass  # the socket only sends; the API takes commands

    async def job_message(self, event):
        await self.send_json(event["message"])
