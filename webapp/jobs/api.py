"""JSON API of jobs: list and create (planned by a Celery task), read, launch, cancel."""

from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import get_object_or_404

from webapp.accounts.auth import api, error
from webapp.jobs import runs
from webapp.jobs.forms import JobForm
from webapp.jobs.submit import submit, visible_jobs


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
    data = {"dataset": "synthetic", "lr": 0.05, "bandwidth_mbps": 1000.0, **request.json}
    if isinstance(data.get("devices"), str):
        data["devices"] = [data["devices"]]
    form = JobForm(data)
    if not form.is_valid():
        return form_error(form)
    job = submit(request.user, form.cleaned_data)
    return JsonResponse(job.to_dict(), status=201)


@api("GET")
def job(request, job_id: int):
    return JsonResponse(get_object_or_404(visible_jobs(request.user), pk=job_id).to_dict())


@api("POST")
def launch(request, job_id: int):
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    try:
        runs.launch(job)
    except runs.LaunchError as exc:
        return error(409, str(exc))
    job.refresh_from_db()
    return JsonResponse(job.to_dict())


@api("POST")
def cancel(request, job_id: int):
    job = get_object_or_404(visible_jobs(request.user), pk=job_id)
    if not runs.cancel(job):
        return error(409, f"job {job.pk} already {job.status}")
    job.refresh_from_db()
    return JsonResponse(job.to_dict())
