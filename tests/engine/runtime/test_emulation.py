"""Time-dilated emulation: padding, late steps, memory budgets, slower kinds and shaped links in real runs."""

import time

import pytest
import torch
from torch import nn

from engine.errors import UserError
from engine.models import get_model
from engine.runtime.emulation import Clock, DeviceOutOfMemory, MemoryMeter, auto_dilation, now
from engine.runtime.launcher import RunOptions, train
from tests.engine.runtime.helpers import cluster_of, make_plan, sized_workload


def test_clock_pads_to_dilated_device_time_and_counts_late_steps():
    clock = Clock(50.0)
    start = now()
    end = clock.pad(start, 0.002)  # 2 ms of device time = 100 ms of wall time
    assert end == pytest.approx(start + 0.1)
    assert now() >= start + 0.1
    assert clock.late == 0 and clock.steps == 1
    clock.pad(now() - 1.0, 0.001)  # started a second ago, target 50 ms: already late
    assert clock.late == 1 and clock.steps == 2 and clock.overrun_s > 0.9
    clock.pad(now(), 0.001, compute=False)  # a transfer is padded but never counted
    assert clock.steps == 2
    assert clock.device(5.0) == pytest.approx(0.1) and clock.wall(0.1) == pytest.approx(5.0)


def test_a_real_device_is_not_padded():
    clock = Clock(None)
    t = time.monotonic()
    clock.pad(t, 10.0)
    assert time.monotonic() - t < 0.5
    assert clock.device(3.0) == 3.0 and clock.late == 0
    with pytest.raises(UserError, match="dilation"):
        Clock(0.0)
    assert auto_dilation(10.0, processes=4, cores=2) == 40.0  # two devices per core, 2x headroom
    assert auto_dilation(10.0, processes=1, cores=2) == 20.0 and auto_dilation(0.1, 1, 2) == 1.0


def test_memory_meter_counts_saved_activations_once_and_enforces_the_budget():
    layer = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    params = list(layer.parameters())
    static = sum(p.numel() * 4 for p in params) * 3  # weights, gradients, one momentum buffer
    meter = MemoryMeter("nano-0", None, params, params, optimizer_states=1)
    assert meter.current == static
    x = torch.randn(64, 256)
    with meter.forward(0):
        out = layer(x)
    held = meter.current - static
    # input, first output and ReLU output are saved (64 x 256 floats each); weights are not counted again
    assert 64 * 256 * 4 * 2 <= held <= 64 * 256 * 4 * 3
    out.sum().backward()
    meter.release(0)
    assert meter.current == static and meter.peak == static + held
    tight = MemoryMeter("nano-0", static + held // 2, params, params, optimizer_states=1)
    with pytest.raises(DeviceOutOfMemory, match="device nano-0 ran out of memory"):
        with tight.forward(0):
            layer(x)


def test_what_the_meter_saw_is_freed_after_a_split_backward():
    """A zero-bubble stage's B keeps the graph for its W; once W ran nothing of the micro-batch may stay alive
    (the meter's hook used to hold each node's saved output: a cycle through the graph, ~1 GB an iteration)."""
    import gc
    import weakref

    from engine.runtime.backward import SplitBackward

    # the sigmoid saves its output, and its node lies on the input's gradient path only: B runs it, W never does
    layer = nn.Sequential(nn.Sigmoid(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    meter = MemoryMeter("nx-0", None, list(layer.parameters()), list(layer.parameters()), optimizer_states=1)
    split = SplitBackward(layer)
    alive = []
    layer[0].register_forward_hook(lambda module, args, out: alive.append(weakref.ref(out)))
    for mb in range(3):
        x = torch.randn(8, 64, requires_grad=True)
        with meter.forward(mb):
            out = layer(x)
        split.input_gradient(mb, out, torch.ones(8, 64), x)
        split.weight_gradient(mb)
        meter.release(mb)
        del out, x
    gc.collect()
    assert len(alive) == 3 and [r() for r in alive] == [None, None, None]
    assert all(p.grad is not None for p in layer.parameters())


def test_a_slower_device_kind_really_takes_longer_in_device_time():
    # 4 samples x 1 GFLOP on a Xavier NX (422 GFLOP/s sustained) is ~10 ms of device time; a Nano is 3.6x slower
    w = sized_workload("mobilenetv2", 1e9)
    measured, predicted = {}, {}
    for kind in ("nx", "nano"):
        plan = make_plan("mobilenetv2", cluster_of(kind), 8, 2, [(0, 21, [(f"{kind}-0", 4)])])
        result = train(plan, w, RunOptions(iterations=3, dilation=25.0, dataset_size=64))
        assert result.late_steps <= 1  # a one-off host hiccup may overrun a step; the timing is checked below
        measured[kind], predicted[kind] = result.measured_iteration_s, result.predicted_iteration_s
        assert measured[kind] == pytest.approx(predicted[kind], rel=0.1)
    # the Nano's peak is 3.6x lower; fixed per-layer costs, equal on both, bring the ratio down a little
    assert measured["nano"] / measured["nx"] == pytest.approx(predicted["nano"] / predicted["nx"], rel=0.1)
    assert measured["nano"] / measured["nx"] > 2.5


def test_a_shaped_link_really_limits_bandwidth():
    # Two stages: every micro-batch crosses the link forward (activations) and backward (gradients).
    model, cut, samples, micro = "mobilenetv2", 3, 4, 2
    spec = get_model(model)
    x, _ = spec.example_batch(1)
    with torch.no_grad():
        for layer in spec.layers()[:cut]:
            layer.eval()
            x = layer(x)
    out_bytes = [4] * 21
    out_bytes[cut - 1] = x.numel() * 4  # the real bytes per sample crossing the cut, so the simulator agrees
    w = sized_workload(model, 3e9, tuple(out_bytes))
    runs = {}
    for mbps in (1000.0, 100.0):
        plan = make_plan(
            model, cluster_of("nx", "nx", bandwidth_mbps=mbps), samples * micro, micro,
            [(0, cut, [("nx-0", samples)]), (cut, 21, [("nx-1", samples)])],
        )  # fmt: skip
        runs[mbps] = result = train(plan, w, RunOptions(iterations=3, dilation=25.0, dataset_size=64))
        assert result.late_steps <= 1  # a one-off host hiccup may overrun a step; the timing is checked below
        assert result.measured_iteration_s == pytest.approx(result.simulated_iteration_s, rel=0.1)
    transfer = samples * x.numel() * 4 / 12.5e6  # one slice over 100 Mbps, in device seconds
    # Sends overlap compute, but the first micro-batch's activations and the last one's gradients are on the
    # critical path: two transfers, less the two at 1000 Mbps (a tenth as long).
    assert runs[100.0].measured_iteration_s - runs[1000.0].measured_iteration_s > 1.5 * transfer


def test_now_is_in_the_runs_time_base():
    # a board whose clock is three days behind the site's, and runs 50 ppm fast: its times are the site's
    import time

    from engine.runtime.emulation import now, use_time_base

    local = time.monotonic()
    try:
        use_time_base({"offset_s": 3 * 86400.0, "drift_ppm": 50.0, "ref_s": local - 1000.0, "error_s": 0.001})
        assert abs(now() - (local + 3 * 86400.0 + 50e-6 * 1000.0)) < 0.5
    finally:
        use_time_base(None)
    assert abs(now() - time.monotonic()) < 0.5
