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


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory):
    """A quick (one repeat) real profile of mobilenetv2 in a private cache, for the command-line tests."""
    from engine.profiler import cached_profile
    from engine.workloads import PROFILE_BATCH

    cache = tmp_path_factory.mktemp("profiles")
    mp = pytest.MonkeyPatch()
    mp.setenv("ASTEROID_CACHE_DIR", str(cache))
    cached_profile("mobilenetv2", micro_batch=PROFILE_BATCH, repeats=1, warmup=0)
    yield cache
    mp.undo()
