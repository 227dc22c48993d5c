"""Compression levels per stage boundary: plan at one level, or let `auto` pick each boundary's level.

    plan = plan_compressed("asteroid", problem, allowed=(8, 4), auto=True)

A fixed level compresses every boundary at it (the planner's cost model knows the smaller bytes and the codec
time, so the plan's shape may change). `auto` plans once per level (uncompressed included), keeps the fastest
plan, then sets each boundary in turn to the level that minimises the simulated iteration (the time the
planners choose by), until no boundary changes: the level per boundary, within the allowed ones, that runs
fastest. With `delta`, samples seen before cross as the change of their activation (engine.deltas): the plan
keeps up to the training set's samples per pair of devices, fewer where that would take more than half of
what a device has free.
"""

from __future__ import annotations

from dataclasses import replace

from engine.costmodel import delta_memory, score
from engine.plan import OFF, Plan
from engine.planners import make_plan
from engine.planners.common import NoFeasiblePlan, Problem, best_plan, simulated
from engine.simulator import simulate


def plan_compressed(
    method: str,
    problem: Problem,
    allowed: tuple[int, ...],
    auto: bool,
    delta: bool = False,
    samples: int | None = None,
    progress: bool = False,
) -> Plan:
    """The `method`'s plan with compression: `allowed` levels (empty: off); `auto` chooses per boundary;
    `delta` sends changes of activations, keeping up to `samples` (the training set's size) per pair."""
    if not allowed:
        return make_plan(method, replace(problem, compression=OFF), progress)
    if not auto:
        plan = make_plan(method, replace(problem, compression=allowed[0]), progress)
    else:
        plan = _auto(method, problem, allowed, progress)
    return with_delta(plan, problem, samples) if delta else plan


def with_delta(plan: Plan, problem: Problem, samples: int | None) -> Plan:
    """`plan` sending changes of activations: as many samples per pair as the training set has (`samples`; None:
    unknown), at most what fills half of any device's free memory; unchanged where not one fits."""
    w = problem.workload
    used = score(plan, w).memory_bytes
    per_sample = delta_memory(plan.with_delta(1), w)
    room = [
        (plan.cluster.device(name).memory_bytes - used[name]) // 2 // each
        for name, each in per_sample.items()
        if each > 0
    ]
    cap = min([*room, *([samples] if samples else [])], default=0)
    if cap < 1:
        return plan
    final = plan.with_delta(int(cap))
    return simulated(final.with_prediction(score(final, w)), w)


def _auto(method: str, problem: Problem, allowed: tuple[int, ...], progress: bool) -> Plan:
    """The fastest plan over every level, then each boundary's level refined."""
    plans = []
    for level in (OFF, *allowed):
        try:
            plans.append(make_plan(method, replace(problem, compression=level), progress))
        except NoFeasiblePlan:
            continue
    best = best_plan(plans)
    if best is None:
        raise NoFeasiblePlan(
            f"{method}: model {problem.workload.model!r} at batch size {problem.batch_size} does not fit in the "
            f"memory of {problem.cluster.label}"
        )
    return refine(best, problem, (OFF, *allowed))


def refine(plan: Plan, problem: Problem, choices: tuple[int, ...]) -> Plan:
    """Coordinate descent over the boundaries' levels with the plan's shape (and schedule) fixed, by simulation."""
    levels = [plan.level(b) for b in range(len(plan.stages) - 1)]
    best_t = plan.predicted.expected_s
    changed = True
    while changed:
        changed = False
        for b in range(len(levels)):
            for level in choices:
                if level == levels[b]:
                    continue
                trial = levels[:b] + [level] + levels[b + 1 :]
                t = simulate(plan.with_compression(tuple(trial)), problem.workload, timeline=False).iteration_s
                if t < best_t * (1 - 1e-12):
                    levels, best_t, changed = trial, t, True
    final = plan.with_compression(tuple(levels))
    return simulated(final.with_prediction(score(final, problem.workload)), problem.workload)
