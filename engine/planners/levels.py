"""Compression levels per stage boundary: plan at one level, or let `auto` pick each boundary's level.

    plan = plan_compressed("asteroid", problem, allowed=(8, 4), auto=True)

A fixed level compresses every boundary at it (the planner's cost model knows the smaller bytes and the codec
time, so the plan's shape may change). `auto` plans once per level (uncompressed included), keeps the fastest
plan, then sets each boundary in turn to the level that minimises the simulated iteration (the time the
planners choose by), until no boundary changes: the level per boundary, within the allowed ones, that runs
fastest.
"""

from __future__ import annotations

from dataclasses import replace

from engine.costmodel import score
from engine.plan import OFF, Plan
from engine.planners import make_plan
from engine.planners.common import NoFeasiblePlan, Problem, best_plan, simulated
from engine.simulator import simulate


def plan_compressed(
    method: str, problem: Problem, allowed: tuple[int, ...], auto: bool, progress: bool = False
) -> Plan:
    """The `method`'s plan with compression: `allowed` levels (empty: off); `auto` chooses per boundary."""
    if not allowed:
        return make_plan(method, replace(problem, compression=OFF), progress)
    if not auto:
        return make_plan(method, replace(problem, compression=allowed[0]), progress)
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
