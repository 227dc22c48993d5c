"""Activation-change compression in real runs: the pairs' copies follow a recovery exactly, and they change what
crosses."""

from engine.models import get_model
from engine.runtime.faults import Faults, Leave, parse_fail
from engine.runtime.launcher import RunOptions, train
from engine.runtime.stage import boundary_examples
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

MODEL = "gpt-small"  # no BatchNorm, no dropout: the same messages give the same model
# Single-device stages. Without nano-2 the planner keeps the boundary at layer 6 between nx-0 and tx2-1
# (nx-0 [0, 6) > tx2-1 [6, 10) > nano-3 [10, 11) > tx2-4 [11, 15) on this workload), so that pair's copies
# are carried into the next generation.
STAGES = [
    (0, 6, [("nx-0", 2)]),
    (6, 10, [("tx2-1", 2)]),
    (10, 11, [("nano-2", 2)]),
    (11, 12, [("nano-3", 2)]),
    (12, 15, [("tx2-4", 2)]),
]
# 16 samples in batches of 8: from iteration 2 on every sample has crossed before
OPTIONS = RunOptions(iterations=6, emulate=False, save_model=True, timeout_s=30, dataset_size=16)


def _train(faults, options=OPTIONS, delta=16):
    plan = make_plan(MODEL, cluster_of("nx", "tx2", "nano", "nano", "tx2"), 8, 4, STAGES).with_compression((2,) * 4)
    return train(plan.with_delta(delta), model_workload(MODEL), options, faults=faults, replicate_every=2)


def test_a_replay_from_the_replica_sends_the_same_changes_as_a_run_that_never_failed():
    """nano-2, alone in its stage, is lost in iteration 4: its layers come back from the neighbour's replica
    of iteration 2, so the survivors roll their copies back two iterations and replay. A graceful leave after
    iteration 2 reaches the same plan from copies that were never ahead; both must end in the same model."""
    lost = _train(Faults(fail=(parse_fail("nano-2@4:forward"),)))
    left = _train(Faults(leave=(Leave("nano-2", 2),)))
    assert [g["reason"] for g in lost.generations] == ["start", "lost"]
    assert [g["reason"] for g in left.generations] == ["start", "left"]
    assert lost.generations[1]["plan"] == left.generations[1]["plan"]
    kept = lost.generations[1]["plan"]
    assert kept["delta_samples"] == 16 and [6, 10] in [s["layers"] for s in kept["stages"]]
    assert lost.loss == left.loss
    worst = max((lost.state_dict[k] - left.state_dict[k]).abs().max().item() for k in left.state_dict)
    assert worst == 0.0
    # and the changes did change what crossed: the same run sending every activation whole trains otherwise
    direct = _train(Faults(leave=(Leave("nano-2", 2),)), delta=0)
    assert direct.loss[:2] == left.loss[:2] and direct.loss[2:] != left.loss[2:]


def test_the_kept_activations_count_in_the_device_memory_it_reports():
    """nx-0 keeps, per sample that crossed to tx2-1, the activation both ends reconstructed (bfloat16): its
    reported peak memory holds all 16 of them more than the same run sending every activation whole."""
    spec = get_model(MODEL)
    _, out = boundary_examples(spec, spec.layers(), 0, STAGES[0][1])
    kept = 16 * out.numel() * 2  # 16 samples in bfloat16
    left = _train(Faults(leave=(Leave("nano-2", 2),)))
    direct = _train(Faults(leave=(Leave("nano-2", 2),)), delta=0)
    extra = left.devices["nx-0"]["peak_memory_bytes"] - direct.devices["nx-0"]["peak_memory_bytes"]
    assert kept <= extra <= 2 * kept  # the kept ones, and at most as many that the last iterations replaced
