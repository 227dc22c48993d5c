"""Shared pieces of the runtime tests: hand-made plans, workloads shaped like a zoo model, a reference run."""

from __future__ import annotations

import random

from engine.costmodel import Workload
from engine.devices import Cluster, Device
from engine.models import get_model
from engine.plan import Plan, Share, Stage
from engine.runtime.options import RunOptions
from engine.runtime.reference import one_process
from tests.engine.instances import random_workload


def model_workload(model: str, scale: float = 1.0) -> Workload:
    """A made-up workload with the zoo model's name and layer count (for runs whose timing is not under test)."""
    layers = len(get_model(model).layers())
    w = random_workload(random.Random(0), layers, name=model)
    return Workload(
        model,
        tuple(f * scale for f in w.forward_flops),
        tuple(f * scale for f in w.backward_flops),
        w.output_bytes,
        tuple(1000 for _ in w.saved_bytes),
        tuple(1000 for _ in w.peak_bytes),
        tuple(1000 for _ in w.param_bytes),
        tuple(0 for _ in w.optimizer_bytes),
    )


def cluster_of(*kinds: str, bandwidth_mbps: float = 1000.0) -> Cluster:
    return Cluster(tuple(Device.of_kind(f"{k}-{i}", k) for i, k in enumerate(kinds)), bandwidth_mbps, name="test")


def make_plan(model: str, cluster: Cluster, batch: int, micro_batches: int, stages: list) -> Plan:
    """stages: [(start, end, [(device name, samples), ...]), ...]."""
    return Plan(
        "hand",
        model,
        batch,
        micro_batches,
        tuple(Stage(a, b, tuple(Share(n, s) for n, s in devs)) for a, b, devs in stages),
        cluster,
    )


def reference_run(model: str, batch: int, iterations: int, lr: float, momentum: float = 0.9, seed: int = 0,
                  options: RunOptions | None = None):  # fmt: skip
    """One process training the unpartitioned model on the same batches (engine.runtime.reference): (losses,
    state_dict). `options` gives the recipe; else SGD at `lr`."""
    opts = options or RunOptions(iterations=iterations, lr=lr, momentum=momentum, seed=seed)
    return one_process(model, batch, opts, iterations=iterations)


def sized_workload(model: str, work_per_sample: float, output_bytes: tuple[int, ...] | None = None) -> Workload:
    """A workload with the zoo model's layers whose device time is dominated by `work_per_sample` FLOPs."""
    n = len(get_model(model).layers())
    fwd = tuple(work_per_sample / 3 / n for _ in range(n))
    return Workload(
        model,
        fwd,
        tuple(2 * f for f in fwd),
        output_bytes or tuple(4 for _ in range(n)),
        tuple(1000 for _ in range(n)),
        tuple(1000 for _ in range(n)),
        tuple(1000 for _ in range(n)),
        tuple(0 for _ in range(n)),
    )
