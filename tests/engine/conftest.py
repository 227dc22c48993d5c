"""Engine tests: seeded torch on one thread (two threads on a shared 2-core host swing timings wildly)."""

import json

import pytest
import torch

from tests.engine.runtime.helpers import cluster_of, make_plan


@pytest.fixture(autouse=True)
def _torch_seed_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def plan_file(tmp_path, profile_cache):
    """A two-stage MobileNetV2 plan of three boards (nx, tx2, nano), written as `plan.json`, for the CLI's tests."""
    plan = make_plan(
        "mobilenetv2", cluster_of("nx", "tx2", "nano"), 8, 2,
        [(0, 9, [("nx-0", 4)]), (9, 21, [("tx2-1", 3), ("nano-2", 1)])],
    )  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    return path
