"""Held-out evaluation (`--eval-every`): scored through the pipeline, the same as one process scoring the model."""

import math

import pytest
import torch

from engine.data import get_dataset
from engine.errors import UserError
from engine.models import get_model
from engine.runtime.batches import eval_batches, load
from engine.runtime.launcher import RunOptions, train
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload


def _score(model: str, state_dict: dict, dataset: str, samples: int) -> tuple[float, float | None]:
    """(mean loss, accuracy) of the whole model in one process, eval mode, on the first held-out samples."""
    spec = get_model(model)
    net = spec.sequential()
    net.load_state_dict(state_dict)
    net.eval()
    x, y = load(get_dataset(dataset, spec, train=False), torch.arange(samples))
    with torch.no_grad():
        out = net(x)
    accuracy = None if spec.task == "language-modeling" else float((out.argmax(-1) == y).float().mean())
    return float(spec.loss(out, y)), accuracy


@pytest.mark.parametrize(
    "model, dataset, stages",
    [
        ("vgg16", "digits", [(0, 20, [("nx-0", 4)]), (20, 39, [("tx2-1", 3), ("tx2-2", 1)])]),
        ("gpt-small", "pytext", [(0, 6, [("nx-0", 2), ("tx2-1", 2)]), (6, 15, [("tx2-2", 4)])]),
    ],
)
def test_the_pipelines_held_out_score_is_the_whole_models(model, dataset, stages):
    plan = make_plan(model, cluster_of("nx", "tx2", "tx2"), 8, 2, stages)
    options = RunOptions(
        iterations=3, emulate=False, save_model=True, dataset=dataset, eval_every=2, eval_samples=20, timeout_s=30
    )
    result = train(plan, model_workload(model), options)
    assert [(e["iteration"], e["samples"]) for e in result.evals] == [(1, 16), (2, 16)]  # every 2nd, and the last
    loss, accuracy = _score(model, result.state_dict, dataset, 16)
    last = result.evals[-1]
    assert math.isclose(last["loss"], loss, rel_tol=1e-4)
    if accuracy is None:
        assert last["accuracy"] is None and math.isclose(last["perplexity"], math.exp(loss), rel_tol=1e-4)
    else:
        assert last["perplexity"] is None and math.isclose(last["accuracy"], accuracy, abs_tol=1e-9)
    assert result.to_dict()["eval"][-1]["loss"] == last["loss"]
    assert len(result.iterations) == 3  # the evaluation's steps are not reported as an iteration's


def test_a_held_out_split_smaller_than_a_batch_is_one_clear_error():
    assert eval_batches(359, 64, 512) == 5 and eval_batches(100, 8, 20) == 2
    with pytest.raises(UserError, match="holds no batch of 64"):
        eval_batches(40, 64, 512)
    plan = make_plan("vgg16", cluster_of("nx"), 64, 1, [(0, 39, [("nx-0", 64)])])
    with pytest.raises(UserError, match="lower --batch-size or raise --eval-samples"):
        train(plan, model_workload("vgg16"), RunOptions(dataset="digits", eval_every=1, eval_samples=32, emulate=False))
    with pytest.raises(UserError, match="eval-every must be 0"):
        RunOptions(eval_every=-1)
