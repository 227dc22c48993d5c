"""JSON API of jobs: list and create (planned by a Celery task), read, launch, cancel; staff's device actions on a
running job (remove, add, kill); and the agents' upload of their trained stage."""

from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from webapp.accounts.auth import api, error
from webapp.devices.models import Device
from webapp.jobs import actions, ending, launching, queue
from webapp.jobs.artifacts import job_dir
from webapp.jobs.forms import JobForm
from webapp.jobs.models import JobDevice
from webapp.jobs.submit import submit, visible_job, visible_jobs
from webapp.lib.tokens import bearer


def form_error(form: JobForm) -> JsonResponse:
    """The form's errors as one line (with the field) and per field."""
    fields = {k: [str(m) for m in v] for k, v in form.errors.items()}
    first = next(iter(fields.items()))
    line = first[1][0] if first[0] == "__all__" else f"{first[0]}: {first[1][0]}"
    return JsonResponse({"error": line, "fields": fields}, status=400)


@api("GET", "POST")
def jobs(request):
    if request.method == "GET":
        return JsonResponse({"jobs": [j.to_dict() for j in visible_jobs(request.user)[:100]]})
    form = JobForm()
    unknown = sorted(set(request.json) - set(form.fields))
    if unknown:  # a misspelt field would otherwise be its default without a word
        return error(400, f"unknown field {', '.join(map(repr, unknown))}: the fields are {', '.join(form.fields)}")
    # the form's defaults for what the request leaves out, as on the page
    data = {"dataset": "synthetic", "bandwidth_mbps": 1000.0, "batch_size": 64, **request.json}
    if "iterations" not in data and "epochs" not in data:
        data["iterations"] = form.fields["iterations"].initial
    if isinstance(data.get("devices"), str):
        data["devices"] = [data["devices"]]
    if isinstance(data.get("tags"), list) and all(isinstance(t, str) for t in data["tags"]):
        data["tags"] = ", ".join(data["tags"])  # the JSON's list, or the form's "a, b"
    form = JobForm(data)
    if not form.is_valid():
        return form_error(form)
    job = submit(request.user, form.cleaned_data)
    return JsonResponse(job.to_dict(), status=201)


@api("GET")
def job(request, job_id: int):
    return JsonResponse(visible_job(request.user, job_id).to_dict())


@api("POST")
def launch(request, job_id: int):
    job = visible_job(request.user, job_id)
    try:
        started = launching.launch(job)
    except launching.LaunchError as exc:
        return error(409, str(exc))
    job.refresh_from_db()
    return JsonResponse(job.to_dict(), status=200 if started else 202)  # 202: waiting in line for busy devices


@api("POST", staff=True)
def queue_move(request, job_id: int):
    """POST {"move": "up" | "down" | "first"} (staff): a job waiting in line moved; the job's JSON after it."""
    job = visible_job(request.user, job_id)
    where = request.json.get("move")
    if where not in queue.MOVES:
        return error(400, f'send {{"move": "up", "down" or "first"}}, not {where!r}'[:200])
    try:
        queue.move(job, where)
    except ValueError as exc:
        return error(409, str(exc))
    job.refresh_from_db()
    return JsonResponse(job.to_dict())


@api("POST")
def cancel(request, job_id: int):
    job = visible_job(request.user, job_id)
    if not ending.cancel(job):
        return error(409, f"job {job.pk} already {job.status}")
    job.refresh_from_db()
    return JsonResponse(job.to_dict())


@api("POST", staff=True)
def device_action(request, job_id: int, action: str):
    """POST {"device": NAME} to /api/jobs/<id>/remove/, /add/ or /kill/ (staff): the job's JSON after it."""
    job = visible_job(request.user, job_id)
    name = request.json.get("device")
    if not isinstance(name, str) or not name.strip():
        return error(400, 'send {"device": "<name>"}: the device to ' + action)
    try:
        actions.ACTIONS[action](job, name.strip(), request.user)
    except actions.ActionError as exc:
        return error(409, str(exc))
    job.refresh_from_db()
    return JsonResponse(job.to_dict())


@csrf_exempt  # device credential, no session
@require_POST
def upload_part(request, job_id: int):
    """A device's trained stage, streamed to var/jobs/<job>/part-<rank>.pt (size-limited)."""
    device = Device.for_credential(bearer(request.headers.get("Authorization")))
    if device is None:
        return error(401, "unknown or revoked device credential")
    row = JobDevice.objects.filter(job_id=job_id, device=device).select_related("job").first()
    if row is None:
        return error(404, f"device {device.name} has no part in job {job_id}")
    if row.job.finished:
        return error(409, f"job {job_id} is {row.job.status}: it takes no more parts")
    limit = settings.ASTEROID_MAX_PART_BYTES
    declared = request.headers.get("Content-Length") or "0"
    if not declared.isdigit():
        return error(400, f"Content-Length must be a number of bytes, got {declared[:20]!r}")
    length = int(declared)
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
