"""A job's files under ASTEROID_JOBS_DIR/<job>: the stage weights its devices upload, and the model assembled
from them when the job completes."""

from __future__ import annotations

import io
from pathlib import Path

from django.conf import settings

from engine.errors import UserError
from engine.models import get_model, model_names
from engine.models.weights import user_keys
from webapp.jobs.models import Job, JobDevice


def job_dir(job: Job | int) -> Path:
    """Where a job's files live: its devices' parts and the assembled model."""
    return Path(settings.ASTEROID_JOBS_DIR) / str(job.pk if isinstance(job, Job) else job)


def model_path(job: Job) -> Path:
    return job_dir(job) / "model.pt"


def assemble_model(job: Job) -> str:
    """One state_dict of the whole model from the parts the devices uploaded (keyed as the model: the zoo's layer
    list, or a lab's own module); '' or why it is missing."""
    import torch

    rows = list(JobDevice.objects.filter(job=job, part=True))
    state: dict = {}
    for row in rows:
        try:
            state.update(torch.load(job_dir(job) / f"part-{row.rank}.pt", weights_only=True))
        except (OSError, RuntimeError) as exc:
            return f"the part of {row.name} cannot be read ({exc})"
    if not rows:
        return "no device uploaded its part of the model"
    if job.model not in model_names():  # a lab's own model: in its own keys, as `train --save` writes it
        try:
            state = user_keys(get_model(job.model), state)
        except UserError as exc:
            return f"its model cannot be built here to name its weights ({exc})"
    buf = io.BytesIO()
    torch.save(state, buf)
    model_path(job).write_bytes(buf.getvalue())
    return ""
