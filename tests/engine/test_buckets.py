"""The stage all-reduce in buckets: contiguous buckets from the last layer down, never later than one message
after the step, and the simulator overlapping it with the last backward as the ring allows."""

import math

import pytest

from engine.buckets import SIZES, finish, stage_buckets
from engine.costmodel import Workload, allreduce_s
from engine.devices import Cluster, Device
from engine.simulator import simulate
from engine.steps import device_steps
from tests.engine.runtime.helpers import make_plan


def heavy_workload(layers: int = 8, param_bytes: int = 8 * 2**20) -> Workload:
    """Layers of equal work, each with `param_bytes` of weights: a data-parallel stage with much to sum."""
    n = layers
    return Workload("heavy", (1e9,) * n, (2e9,) * n, (50_000,) * n, (10,) * n, (10,) * n, (param_bytes,) * n,
                    (param_bytes,) * n)  # fmt: skip


def pair(mbps: float = 1000.0) -> Cluster:
    return Cluster((Device.of_kind("a", "nx"), Device.of_kind("b", "nx")), bandwidth_mbps=mbps, latency_ms=0.5)


def test_finish_runs_each_bucket_once_it_is_ready_and_the_one_before_is_done():
    assert finish(0.0, [1.0, 2.0, 3.0], [0.5, 0.5, 0.5]) == 3.5  # each waits for its gradients
    assert finish(0.0, [0.1, 0.2, 0.3], [1.0, 1.0, 1.0]) == pytest.approx(3.1)  # each waits for the ring
    assert finish(5.0, [0.1, 0.2], [1.0, 1.0]) == 7.0  # the links are busy until 5


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("step_s", [0.001, 0.1, 1.0, 10.0])
def test_buckets_cover_the_stage_last_layers_first_and_never_end_later_than_one_message(step_s, weights_only):
    w, c = heavy_workload(), pair()
    dev = c.devices[0]
    buckets = stage_buckets(w, c, dev, 1, 7, ("a", "b"), "off", step_s, weights_only)
    assert buckets[0].end == 7 and buckets[-1].start == 1  # from the last layer down to the first
    assert all(a.start == b.end for a, b in zip(buckets, buckets[1:]))
    readies = [b.ready for b in buckets]
    assert readies == sorted(readies) and readies[-1] == 1.0 and readies[0] > 0
    one = step_s + allreduce_s(w, c, 1, 7, 2, "off", ("a", "b"))  # the whole stage's message after the step
    assert finish(0.0, [r * step_s for r in readies], [b.seconds for b in buckets]) <= one + 1e-12
    if step_s >= 1.0:  # a long backward hides all but the last bucket
        assert len(buckets) > 1
        assert finish(0.0, [r * step_s for r in readies], [b.seconds for b in buckets]) < one - 0.5 * (one - step_s)


def test_one_device_has_no_buckets_and_16_bit_floats_halve_the_bytes():
    w, c = heavy_workload(), pair()
    assert stage_buckets(w, c, c.devices[0], 0, 8, ("a",), "off", 1.0, False) == ()
    whole = stage_buckets(w, c, c.devices[0], 0, 8, ("a", "b"), "off", 0.0, False)  # nothing to hide behind
    half = stage_buckets(w, c, c.devices[0], 0, 8, ("a", "b"), "bf16", 0.0, False)
    assert len(whole) == len(half) == 1 and SIZES[0] == 0  # one message when there is no backward to overlap
    assert half[0].seconds < 0.51 * whole[0].seconds + 2 * 0.5e-3


def test_the_simulator_hides_the_all_reduce_behind_the_last_backward():
    w, c = heavy_workload(), pair()
    plan = make_plan(w.model, c, 64, 4, [(0, 8, [("a", 8), ("b", 8)])])  # one data-parallel stage, 1F1B
    sim = simulate(plan, w)
    last = max((e for e in sim.events if e.kind == "B"), key=lambda e: e.end)
    buckets = device_steps(plan, w)["a"].buckets
    assert len(buckets) > 1
    ready = [last.start + b.ready * (last.end - last.start) for b in buckets]
    assert math.isclose(sim.iteration_s, finish(0.0, ready, [b.seconds for b in buckets]), rel_tol=1e-12)
    reduce = next(e for e in sim.events if e.kind == "all-reduce")
    assert last.start < reduce.start < last.end and math.isclose(reduce.end, sim.iteration_s)
    ar = allreduce_s(w, c, 0, 8, 2, "off", ("a", "b"))
    # what is left after the step: the ring less most of the step it ran under
    assert sim.iteration_s - last.end < ar - 0.8 * (last.end - last.start)
