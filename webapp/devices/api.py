"""JSON API of devices (list; staff add and issue enrollment tokens) and the agents' HTTP endpoints."""

from __future__ import annotations

import json

from django.conf import settings
from django.http import JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from webapp.accounts.auth import api, error
from webapp.devices.forms import DeviceForm
from webapp.devices.models import Device
from webapp.jobs.models import JobDevice
from webapp.jobs.runs import disconnect_agent, job_dir
from webapp.lib.tokens import bearer


def agent_command(request, token: str) -> str:
    """The line to paste on the board."""
    return f"python -m workers.agent --server {request.build_absolute_uri('/').rstrip('/')} --token {token}"


def enrollment(request, device: Device, token: str) -> dict:
    return {"device": device.to_dict(), "enrollment_token": token, "command": agent_command(request, token)}


@api("GET", "POST")
def devices(request):
    if request.method == "GET":
        return JsonResponse({"devices": [d.to_dict() for d in Device.objects.all()]})
    if not request.user.is_staff:
        return error(403, "only staff members may add devices")
    form = DeviceForm({"kind": "jetson-nano", **request.json})
    if not form.is_valid():
        field, messages = next(iter(form.errors.items()))
        return JsonResponse({"error": f"{field}: {messages[0]}", "fields": form.errors}, status=400)
    device = form.save()
    return JsonResponse(enrollment(request, device, device.issue_enrollment()), status=201)


@api("POST", staff=True)
def token(request, device_id: int):
    """A new one-time enrollment token; the device's current credential is revoked at once."""
    device = get_object_or_404(Device, pk=device_id)
    issued = device.issue_enrollment()
    disconnect_agent(device.pk)
    return JsonResponse(enrollment(request, device, issued))


@csrf_exempt  # agents have no session; the enrollment token is the proof
@require_POST
def enroll(request):
    try:
        doc = json.loads(request.body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the request body is not valid JSON")
    given = doc.get("token") if isinstance(doc, dict) else None
    if not isinstance(given, str) or not given:
        return error(400, 'send {"token": "ENROLLMENT_TOKEN"}')
    result = Device.enroll(given)
    if result is None:
        return error(403, "unknown or already used enrollment token; ask an administrator for a new one")
    device, credential = result
    return JsonResponse({"device": device.to_dict(), "credential": credential})


@csrf_exempt  # device credential, no session
@require_POST
def upload_part(request, job_id: int):
    """A device's trained stage, streamed to var/jobs/<job>/part-<rank>.pt (size-limited)."""
    device = Device.for_credential(bearer(request.headers.get("Authorization")))
    if device is None:
        return error(401, "unknown or revoked device credential")
    row = JobDevice.objects.filter(job_id=job_id, device=device).first()
    if row is None:
        return error(404, f"device {device.name} has no part in job {job_id}")
    limit = settings.ASTEROID_MAX_PART_BYTES
    length = int(request.headers.get("Content-Length") or 0)
    if length > limit:
        return error(413, f"part of {length} bytes is over the limit of {limit}")
    folder = job_dir(job_id)
    folder.mkdir(parents=True, exist_ok=True)
    tmp, path = folder / f"part-{row.rank}.tmp", folder / f"part-{row.rank}.pt"
    size = 0
    with open(tmp, "wb") as out:
        # Read the stream, not request.body: the body would be held in memory and capped at 2.5 MB.
        while chunk := request.read(1 << 20):
            size += len(chunk)
            if size > limit:
                out.close()
                tmp.unlink()
                return error(413, f"part is over the limit of {limit} bytes")
            out.write(chunk)
    tmp.replace(path)
    JobDevice.objects.filter(pk=row.pk).update(part=True)
    return JsonResponse({"stored": size})
