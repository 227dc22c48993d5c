"""Workloads of zoo models, from their cached host profiles (profiling on first use, with progress)."""

from __future__ import annotations

import sys

from engine.costmodel import Workload
from engine.models import get_model
from engine.profiler import cached_profile

# Per-sample costs are measured at this micro-batch size (small enough for every model on a 2-core host).
PROFILE_BATCH = 8


def workload(model: str, profile_batch: int = PROFILE_BATCH, refresh: bool = False, optimizer: str = "sgd") -> Workload:
    """The planning workload of a zoo model; unknown names raise UserError listing the models."""
    spec = get_model(model)
    profile = cached_profile(
        spec, micro_batch=profile_batch, refresh=refresh, progress=sys.stderr.isatty(), optimizer=optimizer
    )
    return Workload.from_profile(profile)
