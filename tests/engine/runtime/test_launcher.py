"""Real multi-process runs: every model family trains, a killed device stops the run naming it, bad runs are refused."""

import os
import signal
import time

import pytest

from engine.errors import UserError
from engine.runtime.launcher import RunOptions, train
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload


@pytest.mark.parametrize(
    "model, stages, batch, micro",
    [
        ("mobilenetv2", [(0, 9, [("nx-0", 8)]), (9, 21, [("tx2-1", 5), ("nano-2", 3)])], 16, 2),  # cnn
        ("bert-small", [(0, 4, [("nx-0", 3), ("tx2-1", 1)]), (4, 10, [("nano-2", 4)])], 16, 4),  # transformer
    ],
)
def test_each_family_trains_and_its_loss_falls(model, stages, batch, micro):
    plan = make_plan(model, cluster_of("nx", "tx2", "nano"), batch, micro, stages)
    events = []
    result = train(
        plan,
        model_workload(model),
        RunOptions(iterations=8, lr=0.02, emulate=False, dataset_size=2 * batch),
        on_event=events.append,
    )
    loss = result.loss
    assert len(loss) == 8
    assert sum(loss[-2:]) / 2 < sum(loss[:2]) / 2 - 0.05, loss
    kinds = {e["type"] for e in events}
    assert {"run-start", "device-start", "step", "iteration", "device-done", "run-stop"} <= kinds
    steps = [e for e in events if e["type"] == "step"]
    # every device ran a forward and a backward of every micro-batch in every iteration
    for name in plan.device_names:
        for kind in ("F", "B"):
            assert sum(1 for e in steps if e["device"] == name and e["kind"] == kind) == 8 * micro
    assert any(e["kind"] == "all-reduce" for e in steps)
    assert any(e["kind"] == "send" and e["peer"] for e in steps)
    assert events[-1] == {"type": "run-stop", "status": "completed", "wall_s": pytest.approx(result.wall_s, abs=1)}


def test_steps_every_s_reports_one_iteration_in_n_and_every_iteration_still_commits():
    opts = RunOptions(steps_every_s=1.0)
    assert [k for k in range(3, 12) if opts.reports_steps(k, 3, 0.25)] == [3, 7, 11]  # 1 s / 0.25 s: one in 4
    assert all(opts.reports_steps(k, 0, 2.0) for k in range(5))  # iterations longer than the period: all
    assert all(RunOptions().reports_steps(k, 0, 0.01) for k in range(5))  # 0: every iteration (the default)
    with pytest.raises(UserError, match="steps-every must be 0"):
        RunOptions(steps_every_s=-1.0)
    plan = make_plan("mobilenetv2", cluster_of("nx", "tx2"), 8, 2, [(0, 9, [("nx-0", 4)]), (9, 21, [("tx2-1", 4)])])
    events = []
    opts = RunOptions(iterations=4, emulate=False, dataset_size=16, steps_every_s=1e6)  # only the first
    result = train(plan, model_workload("mobilenetv2"), opts, on_event=events.append)
    assert len(result.loss) == 4
    assert sorted({e["iteration"] for e in events if e["type"] == "step"}) == [0]
    assert [e["iteration"] for e in events if e["type"] == "iteration"] == [0, 1, 2, 3]


def test_a_killed_device_is_named_with_the_iteration_users_see_and_the_run_goes_on_without_it():
    plan = make_plan(
        "mobilenetv2",
        cluster_of("nx", "tx2", "nano"),
        8,
        2,
        [(0, 7, [("nx-0", 4)]), (7, 14, [("tx2-1", 4)]), (14, 21, [("nano-2", 4)])],
    )
    pids = {}
    killed = {}
    events = []

    def on_event(ev):
        events.append(ev)
        if ev["type"] == "device-start":
            pids[ev["device"]] = ev["pid"]
        if ev["type"] == "iteration" and ev["iteration"] == 1 and not killed:
            os.kill(pids["tx2-1"], signal.SIGKILL)
            killed["at"] = time.monotonic()

    result = train(
        plan, model_workload("mobilenetv2"), RunOptions(iterations=5, emulate=False, timeout_s=10.0), on_event
    )
    (lost,) = [e for e in events if e["type"] == "device-lost"]
    # killed after the second iteration (index 1) completed: lost during the third, as every line counts
    assert lost["device"] == "tx2-1" and lost["iteration"] == 3 and "SIGKILL" in lost["cause"]
    assert lost["detected_real_s"] < 5
    assert len(result.loss) == 5 and "tx2-1" not in result.devices


def test_a_plan_that_does_not_fit_is_refused_before_starting():
    plan = make_plan("mobilenetv2", cluster_of("nano"), 4096, 1, [(0, 21, [("nano-0", 4096)])])
    w = model_workload("mobilenetv2")
    big = type(w)(
        w.model, w.forward_flops, w.backward_flops, w.output_bytes, tuple(10**6 for _ in w.saved_bytes),
        w.peak_bytes, w.param_bytes, w.optimizer_bytes,
    )  # fmt: skip
    with pytest.raises(UserError, match="does not fit in memory on nano-0"):
        train(plan, big, RunOptions(iterations=1))


def test_bad_options_are_one_line_errors():
    for kwargs, message in (
        ({"iterations": 0}, "iterations"),
        ({"lr": -1}, "learning rate"),
        ({"timeout_s": 0}, "timeout"),
        ({"dilation": 0}, "dilation"),
    ):
        with pytest.raises(UserError, match=message):
            RunOptions(**kwargs)
