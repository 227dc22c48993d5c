"""Job pages: new job, plan (with launch and re-plan), live view, cancel, downloads."""

from __future__ import annotations

import json

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import FileResponse, Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils.text import slugify
from django.views.decorators.http import require_POST

from engine.errors import UserError
from engine.events import StepEvent
from engine.trace import chrome_trace
from webapp.accounts.auth import staff_required
from webapp.catalog.models import LabModel, name_of
from webapp.devices.models import Device
from webapp.jobs import actions, ending, figures, launching, planning, rows
from webapp.jobs.artifacts import model_path
from webapp.jobs.forms import JobForm
from webapp.jobs.models import Job, JobDevice, JobEvent, read_plan
from webapp.jobs.queue import MOVES, move, ordinal
from webapp.jobs.retention import archived_steps
from webapp.jobs.submit import request_of, submit, visible_job


def _job(request, job_id: int) -> Job:
    return visible_job(request.user, job_id)


@login_required
def job_new(request):
    form = JobForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        job = submit(request.user, form.cleaned_data)
        return redirect("job", job_id=job.pk)
    return render(request, "jobs/new.html", {"form": form})


@login_required
def job_detail(request, job_id: int):
    """The plan page: how the job will run and why this plan; launch or re-plan from here."""
    job = _job(request, job_id)
    context = {"job": job, "replan_form": None, "launched": job.plan}
    context["lab_model"] = LabModel.objects.filter(reference=job.model).first()  # a lab's own: its layers
    plan = job.plan_object
    if job.generations:  # the sections below are about the plan as launched; later ones are listed after them
        context["launched"] = job.generations[0]["plan"]
        plan = read_plan(job.generations[0]["plan"])
        context["generations"] = [
            g
            | {
                "figure": figures.pipeline_figure(read_plan(g["plan"])),
                "figure_id": f"fig-generation-{g['generation']}",
                "stage_count": len(g["plan"]["stages"]),
            }
            for g in job.generations
        ]
    if plan:
        predictions = rows.predictions(job.comparison_plans)
        context["figures"] = {
            "pipeline": figures.pipeline_figure(plan),
            "memory": figures.memory_figure(plan),
            "comparison": figures.comparison_figure(predictions),
            "timeline": figures.timeline_figure(
                job.simulation or [], plan.device_names, f"Simulated iteration ({plan.schedule.upper()})"
            ),
        }
        context["comparison_rows"] = rows.comparison_rows(predictions)
        context["device_rows"] = rows.device_rows(plan)
    if job.launched_at is None and job.status in (Job.Status.PLANNED, Job.Status.FAILED):
        initial = {
            **request_of(job),
            "devices": job.device_names or job.requested_devices,
        }
        context["replan_form"] = JobForm(initial=initial)
    return render(request, "jobs/plan.html", context)


@login_required
@require_POST
def job_replan(request, job_id: int):
    job = _job(request, job_id)
    if job.launched_at is not None or job.status not in (Job.Status.PLANNED, Job.Status.FAILED):
        messages.error(request, f"Job {job.pk} is {job.status}; only a job that has not run can be re-planned.")
        return redirect("job", job_id=job.pk)
    form = JobForm(request.POST)
    if not form.is_valid():
        return render(request, "jobs/plan.html", {"job": job, "replan_form": form})
    submit(request.user, form.cleaned_data, job)
    return redirect("job", job_id=job.pk)


@login_required
@require_POST
def job_launch(request, job_id: int):
    job = _job(request, job_id)
    try:
        started = launching.launch(job)
    except launching.LaunchError as exc:
        messages.error(request, str(exc))
        return redirect("job", job_id=job.pk)
    if not started:
        job.refresh_from_db()
        messages.info(request, f"Job {job.pk} is {ordinal(job.place_in_line)} in line: {job.message}. It starts by "
                               "itself when they are free.")  # fmt: skip
    return redirect("job-live", job_id=job.pk)


@staff_required
@require_POST
def job_queue_move(request, job_id: int, where: str):
    """Staff: a job waiting in line one place up or down, or first."""
    job = _job(request, job_id)
    if where not in MOVES:
        raise Http404(f"no such move {where!r}: {', '.join(MOVES)}")
    try:
        move(job, where)
    except ValueError as exc:
        messages.error(request, str(exc))
    return redirect("jobs")


@login_required
def job_live(request, job_id: int):
    job = _job(request, job_id)
    rows = list(JobDevice.objects.filter(job=job))
    names = [r.name for r in rows] or job.device_names  # lost and added ones too
    gone = {r.name for r in rows if r.state in (JobDevice.State.LOST, JobDevice.State.LEFT)}
    context = {"job": job, "devices_json": json.dumps(names), "device_names": names,
               "active_devices": [n for n in job.device_names if n not in gone],
               "has_model": model_path(job).exists(),
               "has_trace": job.compacted or job.events.filter(type="step").exists()}  # fmt: skip
    if request.user.is_staff:
        context["idle_devices"] = [d.name for d in Device.objects.all() if d.available]
    return render(request, "jobs/live.html", context)


@login_required
def job_planned(request, job_id: int):
    """The current plan's compute per device and iteration (s): the live page's speed column measures against it."""
    job = _job(request, job_id)
    plan = job.plan_object
    try:
        planned = planning.planned_compute(plan, job.recipe) if plan else {}
    except UserError as exc:  # no profile of the model here any more: the column stays empty
        return JsonResponse({"planned_s": {}, "error": str(exc)})
    return JsonResponse({"planned_s": planned})


@login_required
def job_logs(request, job_id: int):
    """Each device's agent log lines about the job (`agent-log` events), as text; `?device=NAME` one device's,
    `?download=1` as a file."""
    from datetime import UTC, datetime

    job = _job(request, job_id)
    device = request.GET.get("device", "")[:64]
    rows = job.events.filter(type="agent-log")
    if device:
        rows = rows.filter(device=device)
    lines = []
    for name, ev in rows.values_list("device", "data"):
        when = datetime.fromtimestamp(ev.get("time", 0), UTC).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{when} {name} {ev.get('severity', '')} {ev.get('message', '')}")
    response = HttpResponse("".join(f"{line}\n" for line in lines), content_type="text/plain; charset=utf-8")
    if request.GET.get("download"):
        response["Content-Disposition"] = (
            f'attachment; filename="asteroid-job{job.pk}-{slugify(device) or "devices"}.log"'
        )
    return response


@login_required
def job_health(request, job_id: int):
    """The job's devices' health while it ran (webapp/devices/health.py): a figure and its text alternative."""
    from webapp.devices.health import job_figure

    return JsonResponse(job_figure(_job(request, job_id)))


@staff_required
@require_POST
def job_device_action(request, job_id: int, action: str):
    """Remove, add or kill a device of a running job (staff); the live page asks for confirmation first."""
    job = _job(request, job_id)
    name = request.POST.get("device", "").strip()
    if action not in actions.ACTIONS:
        raise Http404(f"no action {action!r}")
    try:
        actions.ACTIONS[action](job, name, request.user)
    except actions.ActionError as exc:
        messages.error(request, str(exc))
    else:
        done = {"remove": "leaves at the next iteration boundary", "add": "joins at the next iteration boundary",
                "kill": "was killed (SIGKILL); watch the recovery"}[action]  # fmt: skip
        messages.info(request, f"{name} {done}.")
    return redirect("job-live", job_id=job.pk)


@login_required
@require_POST
def job_cancel(request, job_id: int):
    job = _job(request, job_id)
    if not ending.cancel(job):
        messages.error(request, f"Job {job.pk} already {job.status}.")
    return redirect("job-live", job_id=job.pk)


@login_required
def job_model(request, job_id: int):
    """The trained model: one state_dict of the whole (unpartitioned) model."""
    job = _job(request, job_id)
    path = model_path(job)
    if not path.exists():
        why = "it is still running" if not job.finished else f"it {job.status} before every device uploaded its part"
        messages.error(request, f"Job {job.pk} has no trained model: {why}.")
        return redirect("job-live", job_id=job.pk)
    # not the type mimetypes guesses for .pt (a SNES page table, on some systems): a file of bytes to save
    return FileResponse(
        open(path, "rb"),
        as_attachment=True,
        filename=f"asteroid-job{job.pk}-{slugify(name_of(job.model))[:60]}.pt",
        content_type="application/octet-stream",
    )


@login_required
def job_trace(request, job_id: int):
    """Every measured step of the run as a Chrome trace (chrome://tracing, https://ui.perfetto.dev)."""
    job = _job(request, job_id)
    if job.compacted:  # every step is in the archive (those kept in the database too)
        rows = archived_steps(job)
    else:
        rows = JobEvent.objects.filter(job=job, type="step").values_list("data", flat=True).iterator()
    steps = []
    for ev in rows:
        try:
            steps.append(StepEvent.from_message(ev))
        except UserError:  # stored before the site checked events: left out of the trace
            continue
    if not steps:
        messages.error(request, f"Job {job.pk} has no measured steps to trace yet.")
        return redirect("job-live", job_id=job.pk)
    trace = chrome_trace(steps, job.device_names, f"job {job.pk}: {job.plan['method']} {job.model}")
    response = HttpResponse(json.dumps(trace), content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="asteroid-job{job.pk}-trace.json"'
    return response
