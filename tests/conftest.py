"""Test-wide setup: in-memory channel layer and eager Celery when no REDIS_URL is given; fast password hashing;
a quick real profile of mobilenetv2 for tests that plan."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # pytest-django has already read webapp.settings (it does so before any conftest), so adjust the loaded
    # settings here rather than through environment variables. Nothing of this reaches processes tests start.
    from django.conf import settings

    from webapp import celery_app

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # PBKDF2 dominates login tests
    if not settings.REDIS_URL:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
        celery_app.conf.update(broker_url="memory://", result_backend="cache+memory://")
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
