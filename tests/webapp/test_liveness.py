"""Liveness after a site restart: boards unheard while no site process listened are not taken for offline until
they have had a heartbeat period to reconnect; past it, a silent board is."""

import time
from datetime import timedelta

import redis
from django.utils import timezone

from webapp.devices import liveness
from webapp.devices.models import Device
from webapp.jobs.tasks import health_check


def test_boards_get_a_heartbeat_period_to_reconnect_after_the_site_starts(cluster_c, settings):
    nx = cluster_c[0]
    long_ago = timezone.now() - timedelta(seconds=120)  # the site was down two minutes
    Device.objects.filter(pk=nx.pk).update(last_heartbeat=long_ago)
    liveness.listening()  # daphne came back just now
    assert abs(liveness.listening_since() - time.time()) < 5
    assert health_check()["offline"] == 0
    assert Device.objects.get(pk=nx.pk).status == "online"
    silent_s = settings.ASTEROID_HEARTBEAT_S * settings.ASTEROID_MISSED_HEARTBEATS
    with redis.Redis.from_url(settings.REDIS_URL) as client:  # ... as if that were a period and a second ago
        client.hset(liveness._key(), liveness.LISTENING, repr(time.time() - silent_s - 1))
    assert health_check()["offline"] == 1
    assert Device.objects.get(pk=nx.pk).status == "offline"


def test_the_asgi_application_notes_that_the_site_listens():
    import importlib

    import webapp.asgi

    before = time.time()
    importlib.reload(webapp.asgi)  # as daphne imports it when it starts
    assert liveness.listening_since() >= before
