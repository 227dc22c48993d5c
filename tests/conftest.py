"""Test-wide setup: in-memory channel layer and eager Celery when no REDIS_URL is given; fast password hashing."""

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
