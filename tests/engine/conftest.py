"""Engine tests: seeded torch on one thread (two threads on a shared 2-core host swing timings wildly)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_seed_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
