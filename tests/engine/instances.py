"""Random small planning instances (workload + heterogeneous cluster) for planner tests and benchmarks."""

from __future__ import annotations

import functools
import random

from engine.costmodel import Workload
from engine.devices import Cluster, Device

KINDS = ("nano", "tx2", "nx")


def random_workload(rng: random.Random, layers: int, name: str = "synthetic") -> Workload:
    fwd = [rng.uniform(0.2e9, 3e9) for _ in range(layers)]
    return Workload(
        model=name,
        forward_flops=tuple(fwd),
        backward_flops=tuple(f * rng.uniform(1.5, 2.5) for f in fwd),
        output_bytes=tuple(rng.randint(20_000, 2_000_000) for _ in range(layers)),
        saved_bytes=tuple(rng.randint(50_000, 20_000_000) for _ in range(layers)),
        peak_bytes=tuple(rng.randint(50_000, 5_000_000) for _ in range(layers)),
        param_bytes=tuple(rng.randint(10_000, 60_000_000) for _ in range(layers)),
        optimizer_bytes=tuple(rng.randint(10_000, 60_000_000) for _ in range(layers)),
    )


def random_cluster(rng: random.Random, devices: int, bandwidth_mbps: float | None = None) -> Cluster:
    kinds = rng.sample(KINDS, rng.randint(2, 3))
    return Cluster(
        tuple(Device.of_kind(f"d{i}", rng.choice(kinds)) for i in range(devices)),
        bandwidth_mbps=bandwidth_mbps or rng.choice([100.0, 1000.0]),
        name="random",
    )


def layered_workload(
    rng: random.Random, layers: int, act_scale: float = 1.0, param_scale: float = 1.0, name: str = "synthetic"
) -> Workload:
    """A CNN-like workload: "conv" layers (much compute and activation, few parameters) mixed with "fc"
    layers (little compute, many parameters). `act_scale` scales saved/peak activation bytes (large
    values make memory bind), `param_scale` scales parameter and optimizer bytes (small values make
    all-reduce cheap, so data-parallel stages and hybrid plans pay off)."""
    fwd, bwd, out, saved, peak, params, opt = [], [], [], [], [], [], []
    for _ in range(layers):
        if rng.random() < 0.65:  # conv-like
            f, p = rng.uniform(0.5e9, 3e9), rng.randint(100_000, 4_000_000)
            s, o = rng.randint(2_000_000, 20_000_000), rng.randint(50_000, 800_000)
        else:  # fc-like
            f, p = rng.uniform(0.02e9, 0.3e9), rng.randint(20_000_000, 200_000_000)
            s, o = rng.randint(10_000, 400_000), rng.randint(4_000, 40_000)
        fwd.append(f)
        bwd.append(f * rng.uniform(1.5, 2.5))
        out.append(o)
        saved.append(int(s * act_scale))
        peak.append(int(s * act_scale * rng.uniform(0.1, 0.5)))
        params.append(int(p * param_scale))
        opt.append(int(p * param_scale * rng.choice([0, 1, 2])))  # SGD, momentum, Adam
    return Workload(name, tuple(fwd), tuple(bwd), tuple(out), tuple(saved), tuple(peak), tuple(params), tuple(opt))


def unlimited_memory(cluster: Cluster) -> Cluster:
    """The same cluster with (practically) unlimited memory on every device and the same speeds."""
    devices = tuple(Device(d.name, "custom", 1e6, d.gflops, d.reserved_gb) for d in cluster.devices)
    return Cluster(devices, cluster.bandwidth_mbps, cluster.latency_ms, cluster.name)


# (act_scale, param_scale) regimes: cheap memory, memory that binds, memory that (almost) never fits.
REGIMES = ((1.0, 0.1), (1.0, 0.3), (40.0, 0.1), (80.0, 0.1), (80.0, 1.0), (400.0, 3.0))
REGIME_WEIGHTS = (3, 2, 3, 3, 2, 1)


def random_problem(rng: random.Random, max_devices: int = 5, max_layers: int = 6):
    """A small heterogeneous planning problem: 2..max_devices devices of 2-3 Jetson kinds, 3..max_layers
    layers, batch 4-16, 100 or 1000 Mbps, in one of REGIMES. Asteroid gives the closed form's optimum (no
    ranking by simulation), the plan the exhaustive oracle checks."""
    from engine.planners import Problem

    act_scale, param_scale = rng.choices(REGIMES, REGIME_WEIGHTS)[0]
    layers = rng.randint(3, max_layers)
    workload = layered_workload(rng, layers, act_scale, param_scale)
    cluster = random_cluster(rng, rng.randint(2, max_devices))
    return Problem(workload, cluster, rng.choice([4, 6, 8, 12, 16]), rank=False)


@functools.cache
def solved_instance(seed: int):
    """`random_problem(Random(seed))` and every planner's plan for it (None where it raises NoFeasiblePlan).
    Cached: the planner, plan and simulator tests share the (exhaustive) work."""
    from engine.planners import PLANNERS, NoFeasiblePlan, make_plan

    problem = random_problem(random.Random(seed))
    plans = {}
    for method in PLANNERS:
        try:
            plans[method] = make_plan(method, problem)
        except NoFeasiblePlan:
            plans[method] = None
    return problem, plans


def with_device_tables(problem, rng: random.Random, devices: int | None = None):
    """The problem with measured-like per-layer times for its first `devices` devices (default: a random number
    of them): each layer's time is its work over the device's rate times a per-layer factor (as a depthwise conv
    or a norm runs below a device's average)."""
    from dataclasses import replace

    w, tables = problem.workload, {}
    n = rng.randint(1, len(problem.cluster.devices)) if devices is None else devices
    for d in problem.cluster.devices[:n]:
        factors = [rng.uniform(0.5, 2.0) for _ in range(w.num_layers)]
        fwd = [f / d.flops_per_s * k for f, k in zip(w.forward_flops, factors)]
        bwd = [b / d.flops_per_s * k for b, k in zip(w.backward_flops, factors)]
        tables[d.name] = (fwd, bwd)
    return replace(problem, workload=w.with_device_times(tables))


def with_the_oracle(problem):
    """Asteroid's plan and the exhaustive oracle's, or None where the oracle finds none that fits (and then
    Asteroid must not find one either)."""
    import pytest

    from engine.planners import NoFeasiblePlan, asteroid, exhaustive

    try:
        oracle = exhaustive.plan(problem)
    except NoFeasiblePlan:
        with pytest.raises(NoFeasiblePlan):
            asteroid.plan(problem)
        return None
    return asteroid.plan(problem), oracle
