"""Finding jobs again: their name, tags and note (given with the job or set later), the jobs list's search,
filters and order, and jobs as CSV (the list as filtered, or the jobs compared)."""

from __future__ import annotations

import csv
import io
import re

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from webapp.jobs.forms import LabelForm
from webapp.jobs.models import Job
from webapp.jobs.submit import visible_job

SORTS = {"newest": "-created_at", "oldest": "created_at", "name": "name", "model": "model", "status": "status"}
CSV_AT_MOST = 5000  # jobs in one download of the list


def filtered(request, jobs):
    """`jobs` narrowed and ordered by the list's query: q (in name, tags, note or model; or a number), status,
    model, tag, owner (staff) and sort; returns them and the query as given (the form shows it again)."""
    get = request.GET
    query = {k: get.get(k, "").strip()[:200] for k in ("q", "status", "model", "tag", "owner", "sort")}
    if query["q"]:
        q = query["q"]
        words = Q(name__icontains=q) | Q(tags__icontains=q) | Q(note__icontains=q)
        # a number is the job's (or in its words), not any model with a digit ("mobilenetv2")
        jobs = jobs.filter(words | Q(pk=int(q)) if q.isdigit() and len(q) < 18 else words | Q(model__icontains=q))
    if query["status"] in Job.Status.values:
        jobs = jobs.filter(status=query["status"])
    if query["model"]:
        jobs = jobs.filter(model=query["model"])
    if query["tag"]:
        jobs = jobs.filter(tags__iregex=rf"(^|,\s*){re.escape(query['tag'])}(\s*,|$)")
    if query["owner"] and request.user.is_staff:
        jobs = jobs.filter(owner__username=query["owner"])
    return jobs.order_by(SORTS.get(query["sort"], "-created_at"), "-pk"), query


def choices(request, jobs) -> dict:
    """What the list's filters offer: the statuses, and the models and owners among `jobs`, tags in use."""
    models = {m: Job(model=m).model_label for m in jobs.order_by().values_list("model", flat=True).distinct()}
    tags = sorted({t for ts in jobs.values_list("tags", flat=True) for t in Job(tags=ts).tag_list}, key=str.lower)
    owners = sorted(set(jobs.values_list("owner__username", flat=True))) if request.user.is_staff else []
    return {"statuses": Job.Status.choices, "models": sorted(models.items(), key=lambda kv: kv[1].lower()),
            "tags": tags, "owners": owners, "sorts": list(SORTS)}  # fmt: skip


def as_csv(jobs, filename: str) -> HttpResponse:
    """One row per job: what it is, how it ran, what it scored."""
    from engine.runtime.options import settable

    options = list(settable())
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["job", "name", "tags", "owner", "model", "dataset", "status", "batch_size", "iterations",
                     "done_iterations", "devices", "method", "predicted_samples_s", "measured_samples_s",
                     "last_loss", "held_out_loss", "held_out_accuracy", "held_out_perplexity", "compression",
                     "bandwidth_mbps", *options, "created_at", "started_at", "finished_at", "note"])  # fmt: skip
    for job in jobs:
        plan, evals = job.plan_object, job.eval_records
        held = evals[-1] if evals else {}
        loss = (job.latest or {}).get("loss")
        values = job.option_values
        writer.writerow([
            job.pk, _text(job.name), _text("; ".join(job.tag_list)), _text(job.owner.get_username()),
            _text(job.model_label), job.dataset,
            job.status, job.batch_size, job.iterations, job.done_iterations, len(job.device_names),
            plan.method if plan else "", _num(job.predicted_throughput), _num(job.measured), _num(loss),
            _num(held.get("loss")), _num(held.get("accuracy")), _num(held.get("perplexity")), job.compression,
            job.bandwidth_mbps, *[values[o] for o in options], _time(job.created_at), _time(job.started_at),
            _time(job.finished_at), _text(job.note),
        ])  # fmt: skip
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _text(value: str) -> str:
    """Free text as a spreadsheet takes it as text: a cell starting with = + - @ (or a tab, a return) would be a
    formula (CSV injection), so it gets a leading apostrophe."""
    return f"'{value}" if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _num(value) -> str:
    return "" if not isinstance(value, (int, float)) else f"{value:.6g}"


def _time(value) -> str:
    return value.isoformat() if value else ""


@login_required
@require_POST
def job_label(request, job_id: int):
    """Set a job's name, tags and note (its owner, or staff), from its plan or live page."""
    job = visible_job(request.user, job_id)
    form = LabelForm(request.POST)
    if form.is_valid():
        Job.objects.filter(pk=job.pk).update(**form.cleaned_data)
        messages.success(request, f"Job {job.pk}'s name, tags and note are saved.")
    else:
        messages.error(request, " ".join(f"{k}: {v[0]}" for k, v in form.errors.items()))
    target = request.POST.get("next", "")  # back where it was set: only this job's own pages
    if target in (f"/jobs/{job.pk}/", f"/jobs/{job.pk}/live/"):
        return redirect(target)
    return redirect("job", job_id=job.pk)
