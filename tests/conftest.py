"""Test-wide setup: markers by cost (unit, multiprocess, browser); in-memory channel layer, eager Celery and a
private redis-server for the device-event streams when no REDIS_URL is given; fast password hashing; a quick real
profile of mobilenetv2 for tests that plan."""

from pathlib import Path

import pytest

# Tests that start processes (training runs, the site, agents, servers), by path under the repository; a single
# test elsewhere says so itself with @pytest.mark.multiprocess. Everything under tests/e2e is `browser`, the rest
# is `unit`.
MULTIPROCESS = (
    "tests/engine/runtime/",
    "tests/engine/test_bench.py",  # each planning cell is timed in a child process
    "tests/engine/test_cli_train.py",
    "tests/webapp/test_embedded_redis.py",
    "tests/webapp/test_eventstream.py",  # kills a redis-server of its own
    "tests/webapp/test_startsite.py",
    "tests/workers/test_cli.py",
    "tests/workers/test_protocol.py",
)
BROWSER = ("tests/e2e/",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path).relative_to(config.rootpath).as_posix()
        if path.startswith(BROWSER):
            item.add_marker(pytest.mark.browser)
        elif path.startswith(MULTIPROCESS):
            item.add_marker(pytest.mark.multiprocess)
        elif not item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # The suite compares runs with one process on the CPU and counts memory as the CPU path does: on a host with a
    # GPU its runs (whose device is `auto`) stay on the CPU too, every process it starts included, unless the `gpu`
    # tests are asked for (`pytest -m gpu`, which see the GPU; `make gpu-check` is the whole check).
    import os

    if "gpu" not in (config.getoption("markexpr", "") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # pytest-django has already read webapp.settings (it does so before any conftest), so adjust the loaded
    # settings here rather than through environment variables. Nothing of this reaches processes tests start.
    from django.conf import settings

    from webapp import celery_app

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # PBKDF2 dominates login tests
    if not settings.REDIS_URL:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
        celery_app.conf.update(broker_url="memory://", result_backend="cache+memory://")
        # Device events reach a job's coordinator on a Redis stream (webapp/jobs/eventstream.py), as under
        # `make run`: a private redis-server for this session's tests.
        import tempfile

        from webapp.embedded_redis import EmbeddedRedis

        settings.REDIS_URL = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="asteroid-test-redis-"))).start()
    celery_app.conf.update(task_always_eager=True, task_eager_propagates=True)


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory):
    """A quick (one repeat) real profile of mobilenetv2 in a private cache, for tests that plan it."""
    from engine.profiler import cached_profile
    from engine.workloads import PROFILE_BATCH

    cache = tmp_path_factory.mktemp("profiles")
    mp = pytest.MonkeyPatch()
    mp.setenv("ASTEROID_CACHE_DIR", str(cache))
    cached_profile("mobilenetv2", micro_batch=PROFILE_BATCH, repeats=1, warmup=0)
    yield cache
    mp.undo()
