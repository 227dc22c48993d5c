"""Job history: the list (pages, archived ones on request), run again, archive, delete, and jobs compared."""

from __future__ import annotations

import shutil

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from engine.fields import MAX_INT
from webapp.jobs import figures, finding, queue
from webapp.jobs.artifacts import job_dir
from webapp.jobs.models import Job, JobEvent
from webapp.jobs.submit import request_of, submit, visible_job, visible_jobs

PER_PAGE = 50
COMPARED_AT_MOST = 6
UNDER_WAY = (
    *Job.ACTIVE,
    Job.Status.QUEUED,
    Job.Status.PLANNING,
    Job.Status.WAITING,
)  # neither archived nor deleted meanwhile


@login_required
def job_list(request):
    archived = request.GET.get("archived") == "1"
    everything = visible_jobs(request.user).filter(archived=archived)
    jobs, query = finding.filtered(request, everything)
    if request.GET.get("format") == "csv":
        return finding.as_csv(jobs[: finding.CSV_AT_MOST], "asteroid-jobs.csv")
    page = Paginator(jobs, PER_PAGE).get_page(request.GET.get("page"))  # a bad page number: the first or last
    hidden = 0 if archived else visible_jobs(request.user).filter(archived=True).count()
    line = [(k, j) for k, j in enumerate(queue.waiting(), 1) if request.user.is_staff or j.owner_id == request.user.pk]
    context = {"page": page, "jobs": page.object_list, "archived": archived, "hidden": hidden,
               "compare_max": COMPARED_AT_MOST, "line": line, "query": query,
               "filtering": any(v for k, v in query.items() if k != "sort"),
               "choices": finding.choices(request, everything), "pages_query": _without_page(request)}  # fmt: skip
    return render(request, "jobs/list.html", context)


def _without_page(request) -> str:
    """The list's query without its page: the page links add theirs."""
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()


@login_required
@require_POST
def job_again(request, job_id: int):
    """A new job with an earlier one's settings and devices, planned afresh (the devices may have changed)."""
    old = visible_job(request.user, job_id)
    data = request_of(old)
    data["devices"] = old.requested_devices
    job = submit(request.user, data)
    messages.info(request, f"Job {job.pk}: job {old.pk}'s settings again, being planned on today's devices.")
    return redirect("job", job_id=job.pk)


@login_required
@require_POST
def job_archive(request, job_id: int):
    """Archive a job that is not running (out of the list, kept) or bring it back."""
    job = visible_job(request.user, job_id)
    if job.status in UNDER_WAY:
        messages.error(request, f"Job {job.pk} is {job.status}: archive it once it has ended.")
        return redirect("jobs")
    archive = not job.archived
    Job.objects.filter(pk=job.pk).update(archived=archive)
    messages.success(request, f"Job {job.pk} archived." if archive else f"Job {job.pk} is back in the list.")
    return redirect("jobs")


@login_required
@require_POST
def job_delete(request, job_id: int):
    """Delete a job that is not running, with its events and files (trained model, replicas)."""
    job = visible_job(request.user, job_id)
    if job.status in UNDER_WAY:
        messages.error(request, f"Job {job.pk} is {job.status}: cancel it first, or wait for it to end.")
        return redirect("jobs")
    folder, number = job_dir(job), job.pk
    job.delete()  # in one transaction, with its devices' rows, events and actions (on_delete=CASCADE)
    shutil.rmtree(folder, ignore_errors=True)
    messages.success(request, f"Job {number} deleted, with its events and files.")
    return redirect("jobs")


def _iterations(job: Job) -> list[dict]:
    """The job's iterations in order; of one replayed after a recovery, the later."""
    newest = {}
    for it in JobEvent.objects.filter(job=job, type="iteration").values_list("data", flat=True):
        newest[it["iteration"]] = it
    return [newest[k] for k in sorted(newest)]


@login_required
def job_compare(request):
    """Jobs side by side: settings, plan, predicted and measured throughput, loss and held-out score."""
    try:
        ids = list(dict.fromkeys(int(i) for i in request.GET.getlist("jobs")))
    except ValueError:
        messages.error(request, "Compare jobs by their numbers (?jobs=3&jobs=5).")
        return redirect("jobs")
    ids = [i for i in ids if 0 < i <= MAX_INT]  # no job has a number past the database's bigint: unknown ones
    jobs = list(visible_jobs(request.user).filter(pk__in=ids).order_by("pk"))
    if request.GET.get("format") == "csv" and jobs:  # any number of ticked jobs as CSV
        return finding.as_csv(jobs[: finding.CSV_AT_MOST], f"asteroid-jobs-{jobs[0].pk}-{len(jobs)}.csv")
    if len(jobs) < 2 or len(jobs) > COMPARED_AT_MOST:
        messages.error(request, f"Tick 2 to {COMPARED_AT_MOST} jobs to compare them (or any number for CSV).")
        return redirect("jobs")
    series, rows = [], []
    for job in jobs:
        its = _iterations(job)
        evals = job.eval_records
        series.append({"name": f"job {job.pk}", "iterations": its})
        plan = job.plan_object
        last_eval = evals[-1] if evals else {}
        rows.append({
            "job": job,
            "method": plan.method if plan else "–",
            "stages": len(plan.stages) if plan else 0,
            "devices": len(plan.device_names) if plan else 0,
            "final_loss": next((it["loss"] for it in reversed(its) if it.get("loss") is not None), None),
            "held_out": last_eval,
        })  # fmt: skip
    from engine.runtime.options import settable

    options = [{"label": spec["label"], "values": [r["job"].option_values[name] for r in rows]}
               for name, spec in settable().items()]  # fmt: skip
    context = {"rows": rows, "options": options, "figures": figures.compare_figures(series)}
    return render(request, "jobs/compare.html", context)
