"""Cost model: the 1F1B closed form, memory with in-flight micro-batches, all-reduce."""

import math
import random

import pytest

from engine.costmodel import (
    Workload,
    allreduce_s,
    device_memory,
    ideal_throughput,
    iteration_time,
    link_s,
    replica_bytes,
    replication_memory,
    replication_s,
    score,
    stage_terms,
    stage_terms_grid,
)
from engine.devices import LAYER_OVERHEAD_S, Cluster, Device, load_cluster
from engine.errors import UserError
from engine.plan import Plan
from tests.engine.instances import layered_workload, random_cluster, random_workload
from tests.engine.runtime.helpers import make_plan


def uniform_workload(layers: int, fwd=1e9, bwd=2e9, out=100_000, saved=1_000_000, peak=300_000, params=500_000):
    return Workload(
        "uniform",
        (fwd,) * layers,
        (bwd,) * layers,
        (out,) * layers,
        (saved,) * layers,
        (peak,) * layers,
        (params,) * layers,
        (params,) * layers,
    )


def free_comm_cluster(n: int, kind: str = "nx") -> Cluster:
    """Identical devices, links so fast and latency-free that communication costs nothing (to ~1e-17 s)."""
    return Cluster(tuple(Device.of_kind(f"d{i}", kind) for i in range(n)), bandwidth_mbps=1e15, latency_ms=0.0)


def chain_plan(w: Workload, cluster: Cluster, S: int, M: int, m: int, per: int) -> Plan:
    stages = [(s * per, (s + 1) * per, [(cluster.devices[s].name, m)]) for s in range(S)]
    return make_plan(w.model, cluster, m * M, M, stages)


# ---------------------------------------------------------------- closed form and bubble


@pytest.mark.parametrize("S", [1, 2, 3, 5])
@pytest.mark.parametrize("M", [1, 2, 4, 7])
def test_closed_form_for_equal_single_device_stages(S, M):
    per, m = 2, 3
    w = uniform_workload(S * per)
    cluster = free_comm_cluster(S)
    dev = cluster.devices[0]
    f_plus_b = 2 * per * LAYER_OVERHEAD_S + m * per * 3e9 / dev.flops_per_s  # forward + backward of one stage
    pred = score(chain_plan(w, cluster, S, M, m, per), w)
    assert math.isclose(pred.iteration_s, (M + S - 1) * f_plus_b, rel_tol=1e-9)
    assert math.isclose(pred.bubble_fraction, (S - 1) / (M + S - 1), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(pred.throughput, m * M / pred.iteration_s)
    assert pred.fits


def test_iteration_time_formula():
    assert iteration_time([1.0, 3.0, 2.0], [0.5, 0.0, 0.25], 4) == 1 + 3 + 2 + 3 * 3.0 + 0.5
    assert iteration_time([2.0], [0.0], 1) == 2.0


def test_score_is_sum_plus_bottleneck_plus_slowest_allreduce():
    rng = random.Random(7)
    w = random_workload(rng, 6)
    cluster = load_cluster("C", bandwidth_mbps=100)
    plan = three_stage_plan(w, cluster)
    times, ars = [], []
    for p, st in enumerate(plan.stages):
        per_dev = []
        for s in st.devices:
            t = stage_terms(w, cluster, cluster.device(s.name), st.start, st.end, min(3 - p, 3))
            per_dev.append(t.fixed + s.samples * t.per_sample)
        times.append(max(per_dev))
        ars.append(allreduce_s(w, cluster, st.start, st.end, len(st.devices)))
    expect = sum(times) + 2 * max(times) + max(ars)
    assert math.isclose(score(plan, w).iteration_s, expect, rel_tol=1e-12)
    assert max(ars) > 0


def test_stage_terms_follow_the_documented_formula():
    w = random_workload(random.Random(3), 5)
    cluster = Cluster((Device.of_kind("t", "tx2"),), bandwidth_mbps=100, latency_ms=2.0)
    dev = cluster.devices[0]
    bps = 100e6 / 8
    # Middle stage: two neighbours, four messages (activations on, gradients back, each way's input).
    t = stage_terms(w, cluster, dev, 1, 3, 2)
    assert math.isclose(t.fixed, 2 * 2 * LAYER_OVERHEAD_S + 4 * 2e-3)
    work = sum(w.forward_flops[1:3]) + sum(w.backward_flops[1:3])
    assert math.isclose(t.per_sample, work / dev.flops_per_s + (w.output_bytes[0] + w.output_bytes[2]) / bps)
    # First and last stages have one neighbour; a single stage has none.
    assert math.isclose(stage_terms(w, cluster, dev, 0, 2, 1).fixed, 4 * LAYER_OVERHEAD_S + 2 * 2e-3)
    assert math.isclose(stage_terms(w, cluster, dev, 3, 5, 1).fixed, 4 * LAYER_OVERHEAD_S + 2 * 2e-3)
    whole = stage_terms(w, cluster, dev, 0, 5, 1)
    assert math.isclose(whole.fixed, 10 * LAYER_OVERHEAD_S)
    assert math.isclose(whole.per_sample, w.work(0, 5) / dev.flops_per_s)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("M", [1, 2, 3, 4, 6])
def test_memory_grows_with_micro_batches_in_flight(M):
    w = uniform_workload(6, saved=7_000_000, peak=1_000_000, params=2_000_000)
    cluster = free_comm_cluster(3)
    m = 2
    pred = score(chain_plan(w, cluster, 3, M, m, 2), w)
    for s in range(3):
        held = min(3 - s, M)  # stage 0 of 3 holds min(3, M) micro-batches, the last stage one
        static = 2 * (2 * 2_000_000 + 2_000_000)  # two layers of weights + gradients + optimizer state
        expect = static + m * (held * 2 * 7_000_000 + 1_000_000)
        assert pred.memory_bytes[f"d{s}"] == expect
        assert device_memory(w, 2 * s, 2 * s + 2, held, m) == expect
    if M >= 3:
        assert pred.memory_bytes["d0"] > pred.memory_bytes["d1"] > pred.memory_bytes["d2"]


def test_stage_cap_is_the_most_samples_that_fit():
    rng = random.Random(11)
    w = layered_workload(rng, 6, act_scale=40.0, param_scale=0.3)
    cluster = load_cluster("C")
    checked = 0
    for dev in (cluster.device("nano-0"), cluster.device("nx-0")):
        for i in range(6):
            for j in range(i + 1, 7):
                for k in (1, 2, 4):
                    cap = stage_terms(w, cluster, dev, i, j, k).cap
                    if cap == 0:
                        assert w.static_bytes(i, j) + k * w.saved(i, j) + w.peak(i, j) > dev.memory_bytes
                        continue
                    checked += 1
                    assert device_memory(w, i, j, k, cap) <= dev.memory_bytes
                    assert device_memory(w, i, j, k, cap + 1) > dev.memory_bytes
    assert checked > 50


def test_the_grid_of_stage_terms_is_stage_terms_at_every_layer_range():
    rng = random.Random(5)
    checked = capped = 0
    for seed in range(4):
        w = layered_workload(rng, 9, act_scale=[1.0, 40.0][seed % 2], param_scale=[1.0, 0.3][seed % 2])
        cluster = random_cluster(rng, 4)
        d0 = cluster.devices[0]  # a device with measured-like times of its own
        w = w.with_device_times({d0.name: ([f / d0.flops_per_s * rng.uniform(0.5, 2) for f in w.forward_flops],
                                           [b / d0.flops_per_s for b in w.backward_flops])})  # fmt: skip
        for dev in cluster.devices:
            for in_flight in (1, 3):
                fixed, per, cap = stage_terms_grid(w, cluster, dev, in_flight)
                for i in range(9):
                    for j in range(i + 1, 10):
                        t = stage_terms(w, cluster, dev, i, j, in_flight)
                        assert (fixed[i, j], per[i, j], cap[i, j]) == (t.fixed, t.per_sample, t.cap), (dev, i, j)
                        checked += 1
                        capped += t.cap == 0
    assert checked == 4 * 4 * 2 * 45 and capped > 0  # some ranges fit no sample at all


def test_plan_over_memory_is_scored_with_fits_false():
    w = uniform_workload(4, saved=400_000_000, params=50_000_000)
    cluster = load_cluster("D")
    plan = make_plan(w.model, cluster, 16, 1, [(0, 4, [("nano-0", 16)])])
    pred = score(plan, w)
    assert not pred.fits
    assert pred.memory_bytes["nano-0"] > cluster.device("nano-0").memory_bytes
    assert math.isfinite(pred.iteration_s) and pred.iteration_s > 0
    # The same stage split over every device of the cluster fits.
    spread = make_plan(w.model, cluster, 16, 8, [(0, 4, [("tx2-0", 1), ("nano-0", 1)])])
    assert score(spread, w).fits


# ---------------------------------------------------------------- all-reduce


def test_allreduce_zero_for_one_device_and_ring_formula_otherwise():
    w = random_workload(random.Random(5), 4)
    for mbps, lat in ((100, 0.2), (1000, 0.0), (37.5, 3.0)):
        cluster = Cluster((Device.of_kind("a", "nano"),), bandwidth_mbps=mbps, latency_ms=lat)
        assert allreduce_s(w, cluster, 0, 4, 1) == 0.0
        for g in range(2, 7):
            params = sum(w.param_bytes[1:3])
            expect = 2 * (g - 1) / g * params / (mbps * 1e6 / 8) + 2 * (g - 1) * lat / 1000
            assert math.isclose(allreduce_s(w, cluster, 1, 3, g), expect, rel_tol=1e-12)


def test_data_parallel_stage_pays_one_allreduce_per_iteration():
    w = uniform_workload(3)
    cluster = Cluster(tuple(Device.of_kind(f"d{i}", "tx2") for i in range(3)), bandwidth_mbps=100, latency_ms=1.0)
    plan = make_plan(w.model, cluster, 12, 2, [(0, 3, [(f"d{i}", 2) for i in range(3)])])
    t = stage_terms(w, cluster, cluster.devices[0], 0, 3, 1)
    expect = 2 * (t.fixed + 2 * t.per_sample) + allreduce_s(w, cluster, 0, 3, 3)
    assert math.isclose(score(plan, w).iteration_s, expect, rel_tol=1e-12)


# ---------------------------------------------------------------- workload and helpers


def test_workload_rejects_ragged_or_empty_layer_lists():
    with pytest.raises(ValueError, match="saved_bytes"):
        Workload("x", (1.0, 2.0), (1.0, 2.0), (1, 2), (1,), (1, 2), (1, 2), (1, 2))
    with pytest.raises(ValueError, match="no layers"):
        Workload("x", (), (), (), (), (), (), ())


def test_workload_range_sums():
    w = random_workload(random.Random(9), 5)
    assert math.isclose(w.work(1, 4), sum(w.forward_flops[1:4]) + sum(w.backward_flops[1:4]))
    assert w.saved(0, 5) == sum(w.saved_bytes)
    assert w.static_bytes(2, 3) == 2 * w.param_bytes[2] + w.optimizer_bytes[2]
    assert w.peak(1, 3) == max(w.peak_bytes[1:3])
    assert w.boundary_bytes(0, 5) == (0, 0)
    assert w.boundary_bytes(2, 4) == (w.output_bytes[1], w.output_bytes[3])


def test_score_rejects_a_plan_for_another_model_or_malformed():
    w = uniform_workload(3)
    cluster = free_comm_cluster(1)
    plan = make_plan("resnet50", cluster, 4, 1, [(0, 3, [("d0", 4)])])
    with pytest.raises(UserError, match="resnet50"):
        score(plan, w)
    short = make_plan(w.model, cluster, 4, 1, [(0, 2, [("d0", 4)])])
    with pytest.raises(UserError, match="cover"):
        score(short, w)


def test_ideal_throughput():
    w = uniform_workload(2)
    cluster = load_cluster("D")
    total = sum(d.flops_per_s for d in cluster.devices) / w.work(0, 2)
    assert math.isclose(ideal_throughput(w, cluster), total)


# ---------------------------------------------------------------- replication (fault tolerance)


def three_stage_plan(w: Workload, cluster: Cluster) -> Plan:
    return make_plan(
        w.model, cluster, 24, 3,
        [
            (0, 2, [("nx-0", 5), ("tx2-0", 3)]),
            (2, 5, [("nano-0", 8)]),
            (5, 6, [("tx2-1", 4), ("nano-1", 2), ("nano-2", 2)]),
        ],
    )  # fmt: skip


def test_replication_costs_the_slowest_stage_two_copies_amortised_over_K():
    w = random_workload(random.Random(11), 6)
    cluster = load_cluster("C", bandwidth_mbps=100)
    plan = three_stage_plan(w, cluster)
    per_stage = [w.params(a, b) + sum(w.optimizer_bytes[a:b]) for a, b in ((0, 2), (2, 5), (5, 6))]
    assert [replica_bytes(w, a, b) for a, b in ((0, 2), (2, 5), (5, 6))] == per_stage
    expect = max(2 * link_s(cluster, n) for n in per_stage)
    assert math.isclose(replication_s(plan, w), expect, rel_tol=1e-12)
    base = score(plan, w)
    for K in (1, 5, 50):
        with_copies = score(plan, w, replicate_every=K)
        assert math.isclose(with_copies.iteration_s, base.iteration_s + expect / K, rel_tol=1e-12)
        assert with_copies.throughput < base.throughput


def test_replication_memory_is_the_own_snapshot_plus_the_previous_stages_replica_on_its_neighbour():
    w = random_workload(random.Random(12), 6)
    cluster = load_cluster("C", bandwidth_mbps=1000)
    plan = three_stage_plan(w, cluster)
    held = replication_memory(plan, w)
    a, b, c = replica_bytes(w, 0, 2), replica_bytes(w, 2, 5), replica_bytes(w, 5, 6)
    assert held == {"nx-0": a + c, "tx2-0": a, "nano-0": b + a, "tx2-1": c + b, "nano-1": c, "nano-2": c}
    base, copies = score(plan, w).memory_bytes, score(plan, w, replicate_every=10).memory_bytes
    assert {n: copies[n] - base[n] for n in base} == held


def test_replication_that_does_not_fit_makes_the_plan_not_fit():
    mib = 2**20  # per layer 300 MiB of weights and 300 MiB of momentum: a 2-layer stage trains in 1.8 GiB
    w = Workload(
        "big", (1e9,) * 4, (2e9,) * 4, (1000,) * 4, (1000,) * 4, (1000,) * 4, (300 * mib,) * 4, (300 * mib,) * 4
    )
    cluster = Cluster((Device.of_kind("n0", "nano"), Device.of_kind("n1", "nano")), 1000)
    plan = make_plan(w.model, cluster, 1, 1, [(0, 2, [("n0", 1)]), (2, 4, [("n1", 1)])])
    assert score(plan, w).fits
    assert not score(plan, w, replicate_every=100).fits
