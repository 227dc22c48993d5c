"""The compiled search's stage costs equal the cost model's to the last bit, the compiled search plans what the
exhaustive oracle does on clusters past the Python search's old reach, and a cluster of more distinct boards than a
64-bit code of count vectors holds plans."""

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from engine.bench.planner import synthetic_workload
from engine.devices import Cluster, Device
from engine.planners import Problem, asteroid, stagecosts
from engine.planners.common import memory_order
from tests.engine.instances import random_problem, with_device_tables, with_the_oracle


@pytest.mark.parametrize("level", [32, 4])
def test_compiled_stage_costs_equal_the_cost_model(level):
    checked = capped = 0
    for seed in range(25):
        rng = random.Random(seed)
        problem = random_problem(rng, max_devices=7, max_layers=8)
        if seed % 2:
            problem = with_device_tables(problem, rng, devices=1)  # one class runs off its own table
        problem = replace(problem, compression=level, allreduce=rng.choice(["off", "fp16"]))
        M = rng.choice(problem.micro_batch_options)
        search = asteroid._Search(problem, M, exact=True)
        t = stagecosts.tables(search)
        full = [len(c) for c in search.classes]
        strides = search.states()[1]
        L = problem.workload.num_layers
        for i, j in itertools.combinations(range(L + 1), 2):
            for g in itertools.product(*(range(n + 1) for n in full)):
                if not 0 < sum(g) <= search.m:
                    continue
                in_flight = rng.randint(1, 4)
                want = search.split(i, j, g, in_flight)
                got = stagecosts.allocate_time(t, i, j, np.array(g, dtype=np.int64), in_flight)
                assert (got < 0) == (want is None), (seed, i, j, g)
                time, ar, most = stagecosts.memory_free(t, i, j, np.array(g, dtype=np.int64))
                assert ar == search.allreduce_of(i, j, g), (seed, i, j, g)
                c1, bps, c2 = t.ring[int(np.dot(g, strides))]  # the search's constants, by the group's code
                assert stagecosts.ring_s(t.params, t.factor, c1, bps, c2, i, j) == ar, (seed, i, j, g)
                if want is not None:
                    assert got == want[0], (seed, i, j, g, got, want[0])
                    # the closed form without memory is the memory-capped split wherever it fits
                    if in_flight <= most:
                        assert time == want[0], (seed, i, j, g, time, want[0])
                    else:
                        capped += 1
                checked += 1
    assert checked > 2000 and capped >= 10, (checked, capped)  # memory binds in some


def test_compiled_search_matches_the_oracle_on_larger_instances():
    # Up to 6 devices and 6 layers, a different stream of instances from the planner tests'.
    compared = 0
    for seed in range(12):
        found = with_the_oracle(random_problem(random.Random(500 + seed), max_devices=6, max_layers=6))
        if found is None:
            continue
        best, oracle = found
        assert math.isclose(best.predicted.iteration_s, oracle.predicted.iteration_s, rel_tol=1e-9), seed
        compared += 1
    assert compared >= 6, compared


def _ordered_optimum(problem):
    """The published planner's space by brute force: every stage count, cut and micro-batch count, each stage's
    group the next devices of the memory order (devices left over stay idle); the fastest plan that fits."""
    from engine.planners.common import best_plan, device_classes, finish
    from engine.planners.exhaustive import _stages

    classes = device_classes(problem.cluster, problem.workload)
    order = [k for k, c in enumerate(classes) for _ in c]
    n, L, best = len(order), problem.workload.num_layers, None
    for M in problem.micro_batch_options:
        for S in range(1, min(n, L) + 1):
            for cuts in itertools.combinations(range(1, L), S - 1):
                for ends in itertools.combinations(range(1, n + 1), S):
                    groups = [tuple(order[a:b].count(k) for k in range(len(classes))) for a, b in
                              zip((0, *ends), ends)]  # fmt: skip
                    stages = _stages(problem, classes, (0, *cuts, L), groups, problem.batch_size // M, M)
                    plan = stages and finish(problem, "ordered", M, stages)
                    if plan and plan.predicted.fits:
                        best = best_plan([best, plan])
    return best


def test_the_ordered_search_finds_the_optimum_of_its_space(monkeypatch):
    """Past EXACT_LIMIT the search runs over contiguous runs of the memory order, pruned by bounds on the stage's
    work, its all-reduce and the pipeline's fill and drain; on random instances it gives the brute force's optimum
    of that space (and finds no plan where none fits)."""
    monkeypatch.setattr(asteroid, "EXACT_LIMIT", 0)
    compared = 0
    for seed in range(40):
        problem = random_problem(random.Random(900 + seed), max_devices=6, max_layers=6)
        oracle = _ordered_optimum(problem)
        if oracle is None:
            with pytest.raises(asteroid.NoFeasiblePlan):
                asteroid.plan(problem)
            continue
        best = asteroid.plan(problem)
        assert math.isclose(best.predicted.iteration_s, oracle.predicted.iteration_s, rel_tol=1e-9), seed
        compared += 1
    assert compared >= 25, compared


def test_seventy_distinct_boards_plan_in_the_memory_order():
    # one class a board: a mixed-radix code of every count vector would need 70 bits; the ordered search numbers a
    # group by its size (stagecosts.group_code), so nothing overflows
    cluster = Cluster(tuple(Device(f"d{i:02d}", "custom", 4.0 + 0.05 * i, 100.0 + 3 * i) for i in range(70)), name="70")
    assert asteroid.search_size(cluster) > asteroid.EXACT_LIMIT
    plan = asteroid.plan(Problem(synthetic_workload(20), cluster, 64, rank=False))
    used = [s.name for st in plan.stages for s in st.devices]
    assert used == [d.name for d in memory_order(cluster)][: len(used)]  # contiguous runs of the memory order
    assert len(plan.stages) > 1 and plan.predicted.fits and plan.stages[-1].end == 20
