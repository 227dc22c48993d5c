"""When each device's agent last sent a heartbeat, in Redis, written the moment the socket reads it.

    await heard(device_id)          # the agent socket (webapp.agents.consumers), in its event loop
    last_heard([1, 2, 3])           # the health check: {device id: unix time}, for those heard at all
    store_heard([1, 2, 3])          # the database's `last_heartbeat`, in rounds (webapp.agents.rounds)
    listening()                     # a site process (daphne) starts taking agents' sockets
    listening_since()               # the health check: no board is silent for longer than the site has listened

The database's `Device.last_heartbeat` is written by the site's database thread, which an overloaded site runs
minutes behind; a board whose heartbeats wait in that queue is still alive. The health check takes a device for
offline only when neither says it was heard lately. Nor while the site has not been listening for a heartbeat period
yet: boards are not heard while no site process takes their sockets (a restart), and reconnect within seconds. One
hash per site (named after its database, as the event streams are), so every site process and the Celery worker see
the same times, and sites sharing a Redis never mix.
"""

from __future__ import annotations

import asyncio
import time
import weakref

import redis
import redis.asyncio
from django.conf import settings
from django.db.models import Case, F, Value, When
from django.utils import timezone

from webapp.devices.models import Device

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its async client
LISTENING = "listening"  # the hash's field (beside the device ids) of `listening`


def _key() -> str:
    database = settings.DATABASES["default"]
    site = f"{database.get('HOST') or ''}:{database.get('PORT') or ''}/{database['NAME']}"
    return f"asteroid:{site}:heard"


def _async_client() -> redis.asyncio.Redis:
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        # as many connections as the channel layer's pool (webapp/settings.py): redis-py refuses the 101st by
        # default, and a lab of agents' heartbeats arrive together (a refused one would close its socket)
        _clients[loop] = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_timeout=30, max_connections=5000)
    return _clients[loop]


async def heard(device_id: int) -> None:
    """Device `device_id`'s agent sent a heartbeat now (nothing without Redis: then the database alone says)."""
    if settings.REDIS_URL:
        await _async_client().hset(_key(), str(device_id), repr(time.time()))


def last_heard(device_ids: list[int]) -> dict[int, float]:
    """When each of these devices' agents last sent a heartbeat (unix time); those never heard are left out."""
    if not device_ids or not settings.REDIS_URL:
        return {}
    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30) as client:
        values = client.hmget(_key(), [str(i) for i in device_ids])
    return {i: float(v) for i, v in zip(device_ids, values) if v is not None}


def listening() -> None:
    """A site process takes agents' sockets from now (daphne, as it starts: webapp/asgi.py)."""
    if settings.REDIS_URL:
        with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30) as client:
            client.hset(_key(), LISTENING, repr(time.time()))


def listening_since() -> float:
    """When a site process last started taking agents' sockets (unix time; 0.0 if none said so)."""
    if not settings.REDIS_URL:
        return 0.0
    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30) as client:
        value = client.hget(_key(), LISTENING)
    return float(value) if value is not None else 0.0


def store_heard(device_ids: list[int]) -> None:
    """The database's side of heartbeats heard now, for many devices in one statement: `last_heartbeat`, and an
    offline device back (busy if it has a job; disabled and failed devices stay so until staff enable them)."""
    offline = Device.Status.OFFLINE
    Device.objects.filter(pk__in=device_ids).update(
        last_heartbeat=timezone.now(),
        status=Case(
            When(status=offline, job__isnull=False, then=Value(Device.Status.BUSY)),
            When(status=offline, then=Value(Device.Status.ONLINE)),
            default=F("status"),
        ),
    )
