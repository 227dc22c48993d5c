"""Compression between stages in real runs: the links carry the encoded bytes, and a compressed pipeline learns."""

import pytest

from engine.runtime.launcher import train
from engine.runtime.options import RunOptions
from engine.simulator import simulate
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

# mobilenetv2 cut after its 5th and 12th layers: activations and gradients cross two boundaries
STAGES = [(0, 5, [("nx-0", 8)]), (5, 12, [("tx2-1", 5), ("tx2-2", 3)]), (12, 21, [("nano-3", 8)])]


def _plan(levels: tuple[int, ...]):
    # 8 micro-batches: each forward also moves batch norm's running statistics, which the held-out score uses
    plan = make_plan("mobilenetv2", cluster_of("nx", "tx2", "tx2", "nano"), 64, 8, STAGES)
    return plan.with_compression(levels)


def test_a_4_bit_pipeline_learns_digits_and_sends_an_eighth_of_the_bytes():
    plan = _plan((4, 4))
    options = RunOptions(
        iterations=30, lr=0.05, dataset="digits", emulate=False, eval_every=15, eval_samples=128, timeout_s=60
    )
    result = train(plan, model_workload("mobilenetv2"), options)
    first, last = result.evals[0], result.evals[-1]
    assert len(result.evals) == 2 and last["iteration"] == 29
    # held-out accuracy rises well above chance (10 classes)
    assert last["accuracy"] >= 0.35, result.evals
    assert last["accuracy"] > first["accuracy"] + 0.15, result.evals
    # 4-bit activation codes (8x fewer bytes than float32) and 8-bit gradients (4x): 5.3x, a little more
    # with the held-out evaluation's forward-only activations, a little less with the scale headers
    assert result.payload_bytes > 0
    assert 4.8 < result.payload_bytes / result.wire_bytes < 6
    for name in plan.device_names:
        device = result.devices[name]
        assert device["payload_bytes"] > 0 and device["wire_bytes"] < device["payload_bytes"]


def test_mixed_levels_reach_each_boundary_and_the_plan_json_keeps_them():
    plan = _plan((8, 2))
    options = RunOptions(iterations=2, dataset="digits", emulate=False, timeout_s=60)
    result = train(plan, model_workload("mobilenetv2"), options)
    assert result.to_dict()["plan"]["compression"] == [8, 2]
    sent = {name: (d["payload_bytes"], d["wire_bytes"]) for name, d in result.devices.items()}
    # nx-0 sends activations over the 8-bit boundary only; nano-3 sends gradients over the 2-bit one only,
    # and gradients never cross below 8 bits; the middle stage sends 2-bit activations and 8-bit gradients
    assert 3.5 < sent["nx-0"][0] / sent["nx-0"][1] <= 4.0
    assert 3.5 < sent["nano-3"][0] / sent["nano-3"][1] <= 4.0
    assert 4.5 < sent["tx2-1"][0] / sent["tx2-1"][1] < 16.0


@pytest.mark.parametrize("level", [8, 4, 2])
def test_the_simulator_charges_the_smaller_transfers_and_the_codec(level):
    w = model_workload("mobilenetv2")
    off, packed = simulate(_plan(()), w), simulate(_plan((level, level)), w)
    latency = _plan(()).cluster.latency_s

    def bytes_time(sim) -> float:  # the sends' seconds less their latency: bytes over the bandwidth
        return sum(e.end - e.start - latency for e in sim.events if e.kind == "send")

    # activations at `level` bits, gradients at max(level, 8)
    if level == 8:
        assert bytes_time(packed) == pytest.approx(bytes_time(off) * 8 / 32)
    else:
        assert bytes_time(off) * level / 32 < bytes_time(packed) < bytes_time(off) * 8 / 32
    computes = lambda sim: sum(e.end - e.start for e in sim.events if e.kind in "FB")  # noqa: E731
    assert computes(packed) > computes(off)  # (de)quantisation is paid on the devices


def test_a_16_bit_stage_all_reduce_trains_like_float32_and_the_simulator_halves_its_bytes():
    from dataclasses import replace

    w = model_workload("mobilenetv2")
    options = RunOptions(iterations=4, lr=0.05, dataset="digits", emulate=False, timeout_s=60)
    runs = {fmt: train(replace(_plan(()), allreduce=fmt), w, options) for fmt in ("off", "fp16")}
    assert runs["fp16"].to_dict()["plan"]["allreduce"] == "fp16" and "allreduce" not in runs["off"].to_dict()["plan"]
    # the middle stage's two devices sum 16-bit gradients: the same training, rounded differently
    assert runs["fp16"].loss != runs["off"].loss
    assert runs["fp16"].loss == pytest.approx(runs["off"].loss, rel=0.02)
    latency = _plan(()).cluster.latency_s

    def reduce_time(fmt: str) -> float:  # the all-reduce's seconds less its two latencies
        sim = simulate(replace(_plan(()), allreduce=fmt), w)
        return sum(e.end - e.start - 2 * latency for e in sim.events if e.kind == "all-reduce")

    assert reduce_time("fp16") == pytest.approx(reduce_time("off") / 2)
