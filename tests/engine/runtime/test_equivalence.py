"""A multi-stage run with heterogeneous in-stage shares trains exactly like one process on the whole batch, under
1F1B and under the zero-bubble schedules, whose backward is split into input and weight gradients."""

import pytest
import torch

from engine.models import get_model
from engine.runtime.launcher import RunOptions, train
from engine.schedule import SCHEDULES
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload, reference_run


@pytest.mark.parametrize(
    "stages",
    [
        # 1 device -> 2 devices sharing 3:1 -> 2 devices sharing 1:3 (slices cross between the groups)
        [(0, 5, [("nx-0", 4)]), (5, 11, [("tx2-1", 3), ("nano-2", 1)]), (11, 15, [("nano-3", 1), ("tx2-4", 3)])],
    ],
)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_with_heterogeneous_shares_equals_one_process(stages, schedule):
    # gpt-small has no BatchNorm and no dropout, so every sample is computed independently of the others
    model, batch, micro, iterations, lr = "gpt-small", 16, 4, 3, 0.05
    cluster = cluster_of("nx", "tx2", "nano", "nano", "tx2")
    plan = make_plan(model, cluster, batch, micro, stages).with_schedule(schedule)
    result = train(
        plan,
        model_workload(model),
        RunOptions(iterations=iterations, lr=lr, emulate=False, save_model=True, timeout_s=60),
    )
    ref_losses, ref_state = reference_run(model, batch, iterations, lr)
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert result.state_dict.keys() == ref_state.keys()
    worst = max((result.state_dict[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < 1e-5
    # The exported state_dict is an ordinary one: it loads into the unpartitioned model.
    get_model(model).sequential().load_state_dict(result.state_dict, strict=True)
    assert torch.isfinite(torch.tensor(result.loss)).all()
