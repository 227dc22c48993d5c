"""Baseline planners, judged by the same cost model: dp, gpipe, pipedream, ftpipehd.

Each builds its plan the way its system would, tries every micro-batch count, and returns the fastest
plan that fits; if none fits it returns its best plan marked `fits: false`, so a comparison can say so.
"""

from __future__ import annotations

import math

import numpy as np

from engine.allocation import StageTerms, allocate
from engine.costmodel import allreduce_s, stage_terms, stage_terms_grid
from engine.devices import Device
from engine.plan import Plan, Share, Stage
from engine.planners.common import NoFeasiblePlan, Problem, best_plan, finish, memory_order

UNCAPPED = 1 << 30


def _split(problem: Problem, devices: list[Device], i: int, j: int, m: int, in_flight: int) -> Stage | None:
    """Asteroid's in-stage allocation if it fits, else proportional to speed ignoring memory."""
    terms = [stage_terms(problem.workload, problem.cluster, d, i, j, in_flight) for d in devices]
    res = allocate(terms, [1] * len(devices), m) or allocate(
        [StageTerms(t.fixed, t.per_sample, UNCAPPED) for t in terms], [1] * len(devices), m
    )
    if res is None:
        return None
    return Stage(i, j, tuple(Share(d.name, s[0]) for d, s in zip(devices, res[1])))


def _even(devices: list[Device], i: int, j: int, m: int) -> Stage | None:
    """Equal shares (the homogeneous assumption), remainder to the first devices."""
    if len(devices) > m:
        return None
    q, extra = divmod(m, len(devices))
    return Stage(i, j, tuple(Share(d.name, q + (k < extra)) for k, d in enumerate(devices)))


def _over_micro_batches(problem: Problem, method: str, build) -> Plan:
    """Best plan over every micro-batch count; `build(M)` gives stages or None."""
    plans = []
    for M in problem.micro_batch_options:
        stages = build(M)
        if stages is not None:
            plans.append(finish(problem, method, M, stages))
    found = best_plan(plans)
    if found is None:
        raise NoFeasiblePlan(f"{method}: no plan for batch size {problem.batch_size} on {problem.cluster.name}")
    return found


def dp(problem: Problem) -> Plan:
    """Data parallelism: every device holds the whole model (PyTorch DDP); micro-batches = gradient accumulation."""
    devices = list(problem.cluster.devices)
    L = problem.workload.num_layers
    if problem.batch_size < len(devices):
        raise NoFeasiblePlan(
            f"dp: batch size {problem.batch_size} is smaller than the {len(devices)} devices data parallelism needs"
        )

    def build(M: int):
        st = _split(problem, devices, 0, L, problem.batch_size // M, 1)
        return [st] if st else None

    return _over_micro_batches(problem, "dp", build)


def gpipe(problem: Problem) -> Plan:
    """GPipe: layers split evenly by count, one device per stage, devices in the cluster's order."""
    L = problem.workload.num_layers
    devices = list(problem.cluster.devices)[:L]
    S = len(devices)
    bounds = [k * L // S for k in range(S + 1)]
    return _over_micro_batches(
        problem,
        "gpipe",
        lambda M: [
            Stage(bounds[k], bounds[k + 1], (Share(d.name, problem.batch_size // M),)) for k, d in enumerate(devices)
        ],
    )


def ftpipehd(problem: Problem) -> Plan:
    """FTPipeHD: a chain of single-device stages whose layers are balanced by each device's capacity."""
    w, cluster = problem.workload, problem.cluster
    L = w.num_layers
    devices = sorted(memory_order(cluster)[: min(L, len(cluster.devices))], key=lambda d: -d.memory_bytes)
    S = len(devices)
    # A device's terms are those of every device of its class (`device_classes`), and the same for every micro-batch
    # count but where that count caps the micro-batches in flight: per (class, in flight), every layer range's at once.
    classes = [(d.spec, w.table_key(d)) for d in devices]
    terms: dict[tuple, tuple[np.ndarray, ...]] = {}

    def ranges(s: int, in_flight: int) -> tuple[np.ndarray, ...]:
        """Device s's fixed and per-sample seconds and sample cap as [i, j] arrays (`costmodel.stage_terms_grid`)."""
        key = (classes[s], in_flight)
        if key not in terms:
            terms[key] = stage_terms_grid(w, cluster, devices[s], in_flight)
        return terms[key]

    def build(M: int):
        m = problem.batch_size // M
        # best[s][j]: smallest bottleneck covering layers [0, j) with devices 0..s-1 (the first i on a tie).
        best = np.full((S + 1, L + 1), math.inf)
        cut = np.zeros((S + 1, L + 1), dtype=np.int64)
        best[0, 0] = 0.0
        for s in range(1, S + 1):
            fixed, per, cap = ranges(s - 1, min(S - s + 1, M))
            cost = np.where(cap >= m, fixed + m * per, math.inf)
            for j in range(s, L - (S - s) + 1):
                v = np.maximum(best[s - 1, s - 1 : j], cost[s - 1 : j, j])
                k = int(np.argmin(v))
                if v[k] < best[s, j]:
                    best[s, j], cut[s, j] = v[k], s - 1 + k
        if math.isinf(best[S, L]):  # nothing fits: balance by speed alone, reported as not fitting
            bounds = _proportional_bounds([d.flops_per_s for d in devices], w.work_prefix)
        else:
            bounds, j = [L], L
            for s in range(S, 0, -1):
                j = int(cut[s, j])
                bounds.append(j)
            bounds.reverse()
        return [Stage(bounds[k], bounds[k + 1], (Share(d.name, m),)) for k, d in enumerate(devices)]

    return _over_micro_batches(problem, "ftpipehd", build)


def _proportional_bounds(speeds: list[float], prefix: list[float]) -> list[int]:
    """Cut points giving each device work in proportion to its speed (each at least one layer)."""
    L, S, total = len(prefix) - 1, len(speeds), prefix[-1]
    bounds, acc = [0], 0.0
    for k in range(S - 1):
        acc += speeds[k] / sum(speeds) * total
        j = min(max(bounds[-1] + 1, min(range(L + 1), key=lambda x: abs(prefix[x] - acc))), L - (S - 1 - k))
        bounds.append(j)
    bounds.append(L)
    return bounds


def pipedream(problem: Problem) -> Plan:
    """PipeDream's planner: DP over layers and machine counts with replicated stages, assuming every
    device is the cluster's average device; devices then assigned in the cluster's order, equal shares."""
    w, cluster = problem.workload, problem.cluster
    devices = list(cluster.devices)
    N, L = len(devices), w.num_layers
    speed = sum(d.flops_per_s for d in devices) / N

    def build(M: int):
        m = problem.batch_size // M

        def stage(i: int, j: int, n: int) -> float:
            if n > m:
                return math.inf
            a_in, a_out = w.boundary_bytes(i, j)
            compute = w.work(i, j) * m / (n * speed)
            comm = math.ceil(m / n) * (a_in + a_out) / cluster.bytes_per_s
            return compute + comm + allreduce_s(w, cluster, i, j, n, problem.allreduce) / M

        # A[j][n]: best bottleneck for layers [0, j) on n machines; choice keeps (i, n') of the last stage.
        A = [[math.inf] * (N + 1) for _ in range(L + 1)]
        choice: dict = {}
        for j in range(1, L + 1):
            for n in range(1, N + 1):
                A[j][n], choice[(j, n)] = stage(0, j, n), (0, n)
                for i in range(1, j):
                    for n2 in range(1, n):
                        v = max(A[i][n - n2], stage(i, j, n2))
                        if v < A[j][n]:
                            A[j][n], choice[(j, n)] = v, (i, n2)
        n_best = min(range(1, N + 1), key=lambda n: A[L][n])
        if math.isinf(A[L][n_best]):
            return None
        layout, j, n = [], L, n_best
        while j > 0:
            i, n2 = choice[(j, n)]
            layout.append((i, j, n2))
            j, n = i, n - n2
        layout.reverse()
        stages, used = [], 0
        for i, j, n2 in layout:
            stages.append(_even(devices[used : used + n2], i, j, m))
            used += n2
        return stages

    return _over_micro_batches(problem, "pipedream", build)
