"""Users for web tests: a staff member and a normal user, so "who may see this" is one line away."""

import pytest
from django.contrib.auth import get_user_model

PASSWORD = "correct horse battery staple"


@pytest.fixture
def alice(db):
    """A staff superuser."""
    return get_user_model().objects.create_superuser("alice", "alice@example.com", PASSWORD)


@pytest.fixture
def bob(db):
    """A normal user."""
    return get_user_model().objects.create_user("bob", "bob@example.com", PASSWORD)


@pytest.fixture
def carol(db):
    """Another normal user: bob's jobs are none of her business."""
    return get_user_model().objects.create_user("carol", "carol@example.com", PASSWORD)


@pytest.fixture(autouse=True)
def _nobody_heard():
    """Each test starts with no agent heard (webapp.devices.liveness: device ids repeat from test to test)."""
    import redis
    from django.conf import settings

    from webapp.devices import liveness

    with redis.Redis.from_url(settings.REDIS_URL) as client:
        client.delete(liveness._key())


@pytest.fixture
def own_redis(tmp_path, settings, monkeypatch):
    """A redis-server of the test's own, which it may kill (as `make run`'s embedded one can die): the channel layer,
    the devices' event streams and the heartbeats' times all on it, and no part of the site has found it down yet."""
    from webapp.embedded_redis import EmbeddedRedis
    from webapp.jobs import eventstream
    from webapp.lib.outage import Outage

    server = EmbeddedRedis(tmp_path / "redis")
    settings.REDIS_URL = url = server.start()
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [{"address": url, "socket_timeout": 5}]}}}  # fmt: skip
    monkeypatch.setattr(eventstream, "_client", None)  # made again from REDIS_URL at first use
    monkeypatch.setattr(eventstream, "_held", type(eventstream._held)())
    for outage in Outage.every:
        monkeypatch.setattr(outage, "down", False)
    yield server
    server.stop()


def kill(server) -> None:
    """SIGKILL an EmbeddedRedis's redis-server, and wait for it to be gone."""
    import os
    import signal

    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


@pytest.fixture(autouse=True)
def _jobs_dir(settings, tmp_path):
    """Each test keeps uploaded model parts in its own folder."""
    settings.ASTEROID_JOBS_DIR = tmp_path / "jobs"
    settings.ASTEROID_STORE_PORT = 0  # the store gateway (started at first use) on any free port


@pytest.fixture
def cluster_c(db):
    """The devices of cluster C, registered and online (as if their agents had said hello)."""
    from django.utils import timezone

    from engine.devices import CLUSTERS
    from webapp.devices.models import Device

    return [
        Device.objects.create(
            name=d.name,
            kind=d.kind,
            status=Device.Status.ONLINE,
            last_heartbeat=timezone.now(),
            measured={"emulated": True},
            address="127.0.0.1",
        )
        for d in CLUSTERS["C"].devices
    ]
