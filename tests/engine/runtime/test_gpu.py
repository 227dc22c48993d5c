"""On a CUDA GPU (every device process on it): a pipeline equals one process, fp32 and 16-bit, and a device killed
mid-iteration is recovered there. Skipped, saying why, without a GPU; `make gpu-check` runs these and more."""

import pytest
import torch

from engine.bench.gpu import _equivalence, _recovery

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="GPU TESTS SKIPPED: torch sees no CUDA GPU (the suite hides one unless asked: pytest -m gpu)",
    ),
]


def test_a_pipeline_on_the_gpu_equals_one_process_there():
    lines = _equivalence("cuda")
    assert lines and all(ok for ok, _ in lines), lines


def test_a_device_killed_on_the_gpu_is_recovered_with_the_same_result():
    lines = _recovery("cuda")
    assert all(ok for ok, _ in lines), lines
