"""Planners: Asteroid's hybrid-pipeline DP, the baselines, and the exhaustive oracle, all on one cost model."""

from __future__ import annotations

from collections.abc import Callable

from engine.errors import UserError
from engine.plan import Plan
from engine.planners import asteroid, baselines, exhaustive
from engine.planners.common import NoFeasiblePlan, Problem, scheduled, simulated

PLANNERS: dict[str, Callable[[Problem], Plan]] = {
    "asteroid": asteroid.plan,
    "dp": baselines.dp,
    "gpipe": baselines.gpipe,
    "pipedream": baselines.pipedream,
    "ftpipehd": baselines.ftpipehd,
    "exhaustive": exhaustive.plan,
}
# `--method all` compares these; exhaustive only runs on small instances, so it is asked for by name.
COMPARED = ("asteroid", "dp", "gpipe", "pipedream", "ftpipehd")


def make_plan(method: str, problem: Problem, progress: bool = False) -> Plan:
    """Plan with `method`, simulated (its prediction's `simulated_s`); `progress` draws the Asteroid search's
    rounds on a terminal. Asteroid picks the schedule too; the others run 1F1B unless one is asked for."""
    if method not in PLANNERS:
        raise UserError(f"unknown method {method!r}; known methods: {', '.join(PLANNERS)}, all")
    if method == "asteroid":
        found = asteroid.plan(problem, progress)
    else:
        found = PLANNERS[method](problem)
        if problem.schedule not in ("auto", "1f1b"):
            found = scheduled(found, problem.workload, problem.schedules)
    return found if found.predicted.simulated_s is not None else simulated(found, problem.workload)


__all__ = ["COMPARED", "PLANNERS", "NoFeasiblePlan", "Problem", "make_plan"]
