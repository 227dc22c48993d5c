"""The real peers (DDP, torch pipelining): their plans, and small emulated runs (a few seconds to ~30 s each)."""

import math
import random

import pytest
import torch
from torch import nn

from engine.costmodel import Workload
from engine.data import get_dataset
from engine.devices import CLUSTERS
from engine.errors import UserError
from engine.models import get_model
from engine.runtime import rivals as peers
from engine.runtime.batches import batch_indices, load
from tests.engine.instances import random_workload
from tests.engine.runtime.helpers import sized_workload

D = CLUSTERS["D"]


def test_ddp_plan_is_one_stage_of_every_device_with_equal_shares():
    w = random_workload(random.Random(1), 10)
    plan = peers.ddp_plan(w, D, 18)
    plan.validate(w.num_layers)
    assert plan.method == "ddp" and plan.micro_batches == 1 and plan.batch_size == 18
    (stage,) = plan.stages
    assert (stage.start, stage.end) == (0, 10)
    assert [(s.name, s.samples) for s in stage.devices] == [("tx2-0", 5), ("nano-0", 5), ("nano-1", 4), ("nano-2", 4)]
    with pytest.raises(UserError, match="smaller than the 4 devices"):
        peers.ddp_plan(w, D, 3)


def test_pipelining_plan_splits_layers_evenly_one_device_per_stage():
    w = random_workload(random.Random(2), 10)
    plan = peers.pipelining_plan(w, D, 16, 4)
    plan.validate(w.num_layers)
    assert plan.method == "pipelining" and plan.micro_batches == 4
    assert [(st.start, st.end) for st in plan.stages] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert [[(s.name, s.samples) for s in st.devices] for st in plan.stages] == [
        [("tx2-0", 4)],
        [("nano-0", 4)],
        [("nano-1", 4)],
        [("nano-2", 4)],
    ]
    short = random_workload(random.Random(3), 3)
    assert [st.devices[0].name for st in peers.pipelining_plan(short, D, 6, 3).stages] == ["tx2-0", "nano-0", "nano-1"]
    with pytest.raises(UserError, match="at least 4 micro-batches"):
        peers.pipelining_plan(w, D, 16, 2)
    with pytest.raises(UserError, match="not divisible"):
        peers.pipelining_plan(w, D, 18, 4)


def test_a_plan_that_does_not_fit_is_refused_naming_the_device():
    flops, act, weights = (1e9,) * 21, (10**6,) * 21, (10**9,) * 21  # 21 GB of weights
    huge = Workload("mobilenetv2", flops, flops, act, act, act, weights, weights)
    with pytest.raises(UserError, match="does not fit in memory on .*nano-0"):
        peers.run_ddp(huge, D, 16)


def test_ddp_trains_and_reports_device_time():
    result = peers.run_ddp(sized_workload("mobilenetv2", 3e8), D, 16, iterations=2, dilation=40.0)
    assert result.method == "ddp" and result.dilation == 40.0
    assert len(result.iteration_s) == len(result.loss) == 2
    assert all(math.isfinite(x) for x in result.loss)
    assert all(t > 0 for t in result.iteration_s)
    assert result.predicted_iteration_s > 0 and result.throughput > 0
    assert result.steps == 4 * 2 * 2  # devices x (forward, backward) x iterations
    assert 0 <= result.late_steps <= result.steps


def _single_process_ddp(model_name: str, batch_size: int, iterations: int, seed: int = 0) -> dict:
    """One process training the same batches: each device's share in turn, with that device's dropout stream."""
    spec = get_model(model_name)
    shares = [s.samples for s in peers.ddp_plan(sized_workload(model_name, 1e9), D, batch_size).stages[0].devices]
    data = get_dataset("synthetic", spec, size=2048, seed=seed)
    torch.manual_seed(seed)
    model = nn.Sequential(*spec.layers())
    streams = [torch.get_rng_state()] * len(shares)  # every device built the model from the same seed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for k in range(iterations):
        indices, lo = batch_indices(len(data), batch_size, seed, k), 0
        for r, n in enumerate(shares):
            x, y = load(data, indices[lo : lo + n])
            torch.set_rng_state(streams[r])
            (spec.loss(model(x), y) * n / batch_size).backward()
            streams[r], lo = torch.get_rng_state(), lo + n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def test_ddp_parameters_equal_a_single_process_run_of_the_same_batches():
    # vgg16 has no batch norm (whose statistics would differ per device); dropout follows each device's stream.
    result = peers.run_ddp(sized_workload("vgg16", 1e9), D, 8, iterations=2, dilation=1.0, return_state=True)
    expected = _single_process_ddp("vgg16", 8, 2)
    assert result.state_dict is not None and result.state_dict.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(result.state_dict[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_pipelining_trains_and_reports_device_time():
    result = peers.run_pipelining(sized_workload("mobilenetv2", 3e8), D, 16, 4, iterations=2, dilation=40.0)
    assert result.method == "pipelining"
    assert len(result.iteration_s) == len(result.loss) == 2
    assert all(math.isfinite(x) for x in result.loss)
    assert all(t > 0 for t in result.iteration_s)
    assert result.predicted_iteration_s > 0
    assert result.steps == 4 * 4 * 2 * 2  # stages x micro-batches x (forward, backward) x iterations
    assert 0 <= result.late_steps <= result.steps


def test_a_failing_device_is_reported_with_its_message():
    with pytest.raises(UserError, match="ddp peer: device .* failed: unknown dataset 'nope'"):
        peers.run_ddp(sized_workload("mobilenetv2", 3e8), D, 16, iterations=1, dilation=40.0, dataset="nope")
