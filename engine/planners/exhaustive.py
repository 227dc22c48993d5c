"""Exhaustive planner: scores every plan (stage count, layer cuts, devices per stage) — the oracle for tests.

Devices of one class are interchangeable, so a stage's group is a count vector per class; every ordered
sequence of disjoint non-empty groups is tried, including ones that leave devices idle. Each stage
uses the same in-stage allocation as Asteroid, and every candidate is scored by `costmodel.score`.
Only for small instances: the count grows exponentially.
"""

from __future__ import annotations

import itertools

from engine.allocation import allocate
from engine.costmodel import stage_terms
from engine.errors import UserError
from engine.plan import Plan, Share, Stage
from engine.planners.common import NoFeasiblePlan, Problem, best_plan, device_classes, finish

MAX_PLANS = 2_000_000


def _group_sequences(counts: tuple[int, ...], S: int):
    """Ordered sequences of S disjoint non-empty count vectors within `counts`."""
    if S == 0:
        yield ()
        return
    for g in itertools.product(*(range(c + 1) for c in counts)):
        if any(g):
            rest = tuple(c - x for c, x in zip(counts, g))
            for tail in _group_sequences(rest, S - 1):
                yield (g, *tail)


def plan(problem: Problem) -> Plan:
    w, cluster = problem.workload, problem.cluster
    classes = device_classes(cluster, w)
    counts = tuple(len(c) for c in classes)
    L = w.num_layers
    plans, tried = [], 0
    for M in problem.micro_batch_options:
        m = problem.batch_size // M
        best_for_m = None
        for S in range(1, min(sum(counts), L) + 1):
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *cuts, L)
                for groups in _group_sequences(counts, S):
                    tried += 1
                    if tried > MAX_PLANS:
                        raise UserError(f"exhaustive: more than {MAX_PLANS} plans; use it only on small instances")
                    stages = _stages(problem, classes, bounds, groups, m, M)
                    if stages is None:
                        continue
                    candidate = finish(problem, "exhaustive", M, stages)
                    best_for_m = best_plan([best_for_m, candidate])
        plans.append(best_for_m)
    found = best_plan(plans)
    if found is None or not found.predicted.fits:
        raise NoFeasiblePlan(f"exhaustive: no plan fits for batch size {problem.batch_size} on {cluster.name}")
    return found


def _stages(problem: Problem, classes, bounds, groups, m: int, M: int) -> list[Stage] | None:
    pools = [list(c) for c in classes]
    S = len(groups)
    stages = []
    for p, g in enumerate(groups):
        i, j = bounds[p], bounds[p + 1]
        devices = [pools[k].pop(0) for k, c in enumerate(g) for _ in range(c)]
        terms = [stage_terms(problem.workload, problem.cluster, d, i, j, min(S - p, M)) for d in devices]
        res = allocate(terms, [1] * len(devices), m)
        if res is None:
            return None
        stages.append(Stage(i, j, tuple(Share(d.name, s[0]) for d, s in zip(devices, res[1]))))
    return stages
