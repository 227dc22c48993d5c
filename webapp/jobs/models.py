"""A training job (request, plan, state, latest metrics), the devices it runs on, and its stored events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from engine.metrics import time_left_s
from engine.plan import Plan

PACE_REPORTS = 20  # the iteration reports a running job's time left is paced on


def read_plan(doc: dict | None) -> Plan | None:
    """A stored plan (Plan JSON with the prediction made when it was planned); None for none."""
    return Plan.from_dict(doc, keep_prediction=True) if doc else None


def read_comparison(doc: dict | None) -> dict[str, Plan | str]:
    """A stored comparison: each method's plan, or why it has none."""
    return {
        m: str(p["error"]) if "error" in p else Plan.from_dict(p, keep_prediction=True) for m, p in (doc or {}).items()
    }


class Job(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        PLANNING = "planning", "Planning"
        PLANNED = "planned", "Planned"
        WAITING = "waiting", "Waiting for devices"  # launched while its devices were busy: in line (jobs/queue.py)
        RUNNING = "running", "Running"
        RECOVERING = "recovering", "Recovering"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    FINISHED = (Status.COMPLETED, Status.FAILED, Status.CANCELLED)
    ACTIVE = (Status.RUNNING, Status.RECOVERING)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    # How its owner finds it again (webapp/jobs/finding.py): a name, tags ("a, b": searched as text), a note.
    name = models.CharField(max_length=120, blank=True)
    tags = models.CharField(max_length=400, blank=True)
    note = models.TextField(blank=True)
    # The request.
    model = models.CharField(max_length=600)  # a zoo name, or a registered model's reference (webapp.catalog)
    dataset = models.CharField(max_length=32, default="synthetic")
    batch_size = models.PositiveIntegerField(default=64)
    iterations = models.PositiveIntegerField(default=20)
    bandwidth_mbps = models.FloatField(default=1000.0)
    compression = models.CharField(max_length=16, default="off")  # between stages: off, 8, 4, 2 or auto
    # The run options its owner set (engine.runtime.options.settable(): learning rate, schedule, ...), by name;
    # `option_values` fills in the defaults.
    options = models.JSONField(default=dict, blank=True)
    requested_devices = models.JSONField(default=list, blank=True, help_text="Names; empty: every online device.")
    device_group = models.CharField(max_length=64, blank=True)  # instead of names: a group's devices ...
    device_count = models.PositiveIntegerField(null=True, blank=True)  # ... or any N (webapp.jobs.planning)
    # Where it stands.
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    queue_position = models.BigIntegerField(null=True, blank=True)  # a waiting job's place in line: lower first
    left_out = models.JSONField(default=dict, blank=True)  # {device: why it is not in the plan} (the plan page's)
    progress = models.FloatField(null=True, blank=True)  # 0..1 while planning or running
    message = models.TextField(blank=True)  # why it failed, or what it is doing
    # The plan (Plan JSON), every method's plan or error, and the simulated 1F1B steps of one iteration.
    plan = models.JSONField(null=True, blank=True)  # the plan training now (the newest generation's)
    # Every generation's plan, why it was made and from which iteration it trained: [{generation, plan, reason,
    # start, planning_real_s, predicted_throughput}] (generation 0 is `plan` as launched).
    generations = models.JSONField(default=list, blank=True)
    comparison = models.JSONField(null=True, blank=True)
    simulation = models.JSONField(null=True, blank=True)
    latest = models.JSONField(default=dict, blank=True)  # the last iteration message
    emulated = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    launched_at = models.DateTimeField(null=True, blank=True)  # devices were assigned
    started_at = models.DateTimeField(null=True, blank=True)  # every device accepted; `start` was sent
    finished_at = models.DateTimeField(null=True, blank=True)
    archived = models.BooleanField(default=False, db_index=True)  # kept, but out of the job list unless asked for
    # Its step and iteration events were archived to var/jobs/<job>/events.jsonl.gz, and most left the database
    # (webapp/jobs/retention.py).
    compacted = models.BooleanField(default=False)
    # Which process works on it, and until when its lease holds: while it plans, the Celery worker planning it
    # (webapp/jobs/planlease.py); once it runs, the coordinators process running its coordinator (leases.py).
    coordinator = models.CharField(max_length=128, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"job {self.pk}: {self.model} ({self.status})"

    @property
    def finished(self) -> bool:
        return self.status in self.FINISHED

    @property
    def plan_object(self) -> Plan | None:
        """The plan, parsed once for as long as `plan` stays the same document."""
        return self._parsed("plan", read_plan)

    @property
    def comparison_plans(self) -> dict[str, Plan | str]:
        """Every method's plan or why it has none, parsed once for as long as `comparison` stays the same."""
        return self._parsed("comparison", read_comparison)

    def _parsed(self, field: str, read: Callable[[Any], Any]) -> Any:
        doc, cache = getattr(self, field), self.__dict__.setdefault("_parsed_cache", {})
        if field not in cache or cache[field][0] is not doc:  # `job.plan = ...` or refresh_from_db() replaces it
            cache[field] = (doc, read(doc))
        return cache[field][1]

    @property
    def option_values(self) -> dict[str, Any]:
        """Every settable run option's value (engine.runtime.options.settable()): what it set, else the default."""
        from engine.runtime.options import settable

        return {name: self.options.get(name, spec["default"]) for name, spec in settable().items()}

    @property
    def recipe(self):
        """The run options that say how the job trains (optimizer, schedule, frozen weights, ...): what its plan
        is made for (engine.recipe.planned)."""
        from engine.runtime.options import RunOptions

        return RunOptions(**self.option_values, iterations=self.iterations or 1)

    @property
    def recipe_text(self) -> str:
        """The recipe in words (engine.recipe.describe): "adamw, lr 0.0003 (warm-up 4, then cosine), ..."."""
        from engine.errors import UserError
        from engine.recipe import describe

        try:
            return describe(self.recipe)
        except UserError as exc:  # options an older site stored that no longer validate
            return f"(its options no longer validate: {exc})"

    @property
    def device_names(self) -> list[str]:
        plan = self.plan_object
        return plan.device_names if plan else []

    @property
    def predicted_throughput(self) -> float | None:
        plan = self.plan_object
        return plan.predicted.expected_throughput if plan and plan.predicted else None

    @property
    def measured(self) -> float | None:
        """Measured samples/s: the median iteration of the current plan (generation) so far, as the engine reports
        it with every iteration (engine.metrics.measured_throughput), against its prediction; a completed job's
        is its summary's."""
        value = (self.latest or {}).get("measured_throughput")
        return value if isinstance(value, (int, float)) else None

    @property
    def done_iterations(self) -> int:
        iteration = (self.latest or {}).get("iteration")
        return iteration + 1 if isinstance(iteration, int) else 0

    @property
    def eta_s(self) -> float | None:
        """Seconds until a running job's last iteration, or None: at the pace of its last iteration reports
        (engine.metrics.time_left_s: a replay after a recovery counts as work, and lengthens it), else at the
        whole run's pace (reports that came in one batch)."""
        if self.status not in self.ACTIVE or self.started_at is None:
            return None
        reports = self.events.filter(type="iteration")
        recent = list(reports.order_by("-id").values_list("created_at", "data")[:PACE_REPORTS])[::-1]
        if not recent or recent[-1][1]["iteration"] + 1 >= self.iterations:
            return None
        arrivals = [(at.timestamp(), data["iteration"]) for at, data in recent]
        left = time_left_s(arrivals, self.iterations)
        if left is None:
            elapsed = (timezone.now() - self.started_at).total_seconds()
            left = elapsed / reports.count() * (self.iterations - arrivals[-1][1] - 1)
        return left

    @property
    def tag_list(self) -> list[str]:
        return [t for t in (s.strip() for s in self.tags.split(",")) if t]

    @property
    def place_in_line(self) -> int | None:
        """A waiting job's place in the queue (1: next to start; webapp/jobs/queue.py), else None."""
        if self.status != self.Status.WAITING or self.queue_position is None:
            return None
        ahead = Job.objects.filter(status=self.Status.WAITING, queue_position__lt=self.queue_position).count()
        return ahead + 1

    @property
    def eval_records(self) -> list[dict]:
        """The held-out scores (`eval` events without their type) by iteration; of an iteration scored twice
        (replayed), the later."""
        newest = {}
        for ev in self.events.filter(type="eval").values_list("data", flat=True):
            newest[ev["iteration"]] = {k: v for k, v in ev.items() if k != "type"}
        return [newest[k] for k in sorted(newest)]

    @property
    def model_label(self) -> str:
        """The model as people name it: the zoo's name, a registered model's name, else its file and function."""
        from engine.models.source import is_reference, parse_reference
        from webapp.catalog.models import name_of

        if not is_reference(self.model):
            return self.model
        name = name_of(self.model)
        if name != self.model:
            return name
        ref = parse_reference(self.model)
        return f"{ref.path.name}:{ref.function}" if ref.function else f"hf:{ref.path.name}"

    @property
    def group(self) -> str:
        """The Channels group of the job's browser sockets."""
        return f"job.{self.pk}"

    def to_dict(self) -> dict:
        return {
            "id": self.pk,
            "owner": self.owner.get_username(),
            "name": self.name,
            "tags": self.tag_list,
            "note": self.note,
            "model": self.model,
            "dataset": self.dataset,
            "batch_size": self.batch_size,
            "iterations": self.iterations,
            "bandwidth_mbps": self.bandwidth_mbps,
            "compression": self.compression,
            **self.option_values,
            "devices": self.device_names or self.requested_devices,
            "status": self.status,
            "place_in_line": self.place_in_line,  # waiting for busy devices: 1 is next (webapp/jobs/queue.py)
            "device_group": self.device_group,
            "device_count": self.device_count,
            "left_out": self.left_out,  # {device: why the plan does without it}
            "progress": self.progress,
            "message": self.message,
            "plan": self.plan,
            "generations": [
                {k: g[k] for k in ("generation", "reason", "start", "planning_real_s", "predicted_throughput")}
                for g in self.generations
            ],
            # each method's prediction, with its expected samples/s (simulated where it was), as the plan page shows
            "comparison": {
                m: {"error": p}
                if isinstance(p, str)
                else {**p.predicted.to_dict(), "expected_throughput": p.predicted.expected_throughput}
                for m, p in self.comparison_plans.items()
            },
            "latest": self.latest,  # its "iteration" is the engine's, from 0; done_iterations counts, as pages do
            "done_iterations": self.done_iterations,
            # the plan's expected samples/s (simulated where it was), as the page and the messages say; the plan's
            # own "predicted.throughput" is the closed form's
            "predicted_throughput": self.predicted_throughput,
            "measured_throughput": self.measured,
            "eta_s": self.eta_s,
            "archived": self.archived,
            "eval": self.eval_records,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "started_at": self.started_at.isoformat() if self.started_at else None,
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
        }


class JobDevice(models.Model):
    """One device's part in a job: its rank, whether it accepted, and its state during the run."""

    class State(models.TextChoices):
        ASSIGNED = "assigned"
        STARTING = "starting"
        TRAINING = "training"
        DONE = "done"
        FAILED = "failed"
        STOPPED = "stopped"
        LOST = "lost"  # its process died or went silent; the job recovers without it
        LEFT = "left"  # it left gracefully (removed by an administrator); its layers were handed over
        STANDBY = "standby"  # a re-plan left it out (no faster plan used it); free, planned on again at a change

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="devices")
    device = models.ForeignKey("devices.Device", null=True, on_delete=models.SET_NULL, related_name="+")
    name = models.CharField(max_length=64)
    rank = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.ASSIGNED)
    accepted = models.BooleanField(default=False)
    result = models.JSONField(default=dict, blank=True)  # its device-done report (late steps, peak memory, ...)
    part = models.BooleanField(default=False)  # it uploaded its stage's weights (var/jobs/<job>/part-<rank>.pt)

    class Meta:
        ordering = ["job", "rank"]
        constraints = [models.UniqueConstraint(fields=["job", "rank"], name="one_device_per_rank")]


class JobEvent(models.Model):
    """An event of the job's stream: a runtime event from a device, or a log line of the site."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    device = models.CharField(max_length=64, blank=True)
    type = models.CharField(max_length=32)
    data = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "type"])]


class JobAction(models.Model):
    """An administrator's action on a running job (remove or add a device, kill a device's process): who asked,
    when, and when the job's coordinator carried it out. The audit trail of changes made to a job mid-run."""

    class Kind(models.TextChoices):
        REMOVE = "remove", "remove device"
        ADD = "add", "add device"
        KILL = "kill", "kill device process"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="actions")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    device = models.CharField(max_length=64)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    done_at = models.DateTimeField(null=True, blank=True)  # the coordinator took it (kills: sent at once)
    outcome = models.TextField(blank=True)

    class Meta:
        ordering = ["id"]
