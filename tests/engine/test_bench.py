"""`bench planner` pieces: timing cells run in a child process, and exact search never loses to ordered."""

from __future__ import annotations

from engine.bench.planner import exact_vs_ordered, synthetic_cluster, synthetic_workload, time_planning
from engine.planners import Problem, make_plan


def test_time_planning_reports_the_plan_it_timed():
    seconds, stages, micro_batches, iteration = time_planning(4, 12, timeout=120)
    plan = make_plan("asteroid", Problem(synthetic_workload(12), synthetic_cluster(4), 256))
    assert seconds > 0
    assert (stages, micro_batches) == (len(plan.stages), plan.micro_batches)
    assert iteration == plan.predicted.iteration_s


def test_exact_search_is_never_worse_than_the_published_space():
    lines = exact_vs_ordered((4,), (8, 12), timeout=120)
    rows = [line for line in lines if line.startswith("| 4 |")]
    assert len(rows) == 2
    for row in rows:
        gain = float(row.rstrip(" |").rsplit("|", 1)[1].strip().rstrip(" %"))
        assert gain >= 0
