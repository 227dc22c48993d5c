"""ASGI entry point served by daphne: HTTP (with static files), the browsers' job sockets and the agents' socket."""

import logging
import os

import redis
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
django_asgi = get_asgi_application()  # before importing anything that touches models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from webapp.accounts.sockets import SessionOrToken  # noqa: E402
from webapp.agents.consumers import AgentConsumer  # noqa: E402
from webapp.devices import liveness  # noqa: E402
from webapp.jobs.consumers import JobConsumer  # noqa: E402

websocket = URLRouter(
    [
        # Agents: no browser, no Origin header, no cookie; the device credential authenticates them.
        path("ws/agent/", AgentConsumer.as_asgi()),
        path("ws/jobs/<int:job_id>/", SessionOrToken(JobConsumer.as_asgi())),
        # any other path: the handshake refused (HTTP 403), not a "No route found" error and its traceback
        re_path(r"", WebsocketDenier.as_asgi()),
    ]
)

# One daphne process serves everything, static files included (from the finders, no collectstatic needed).
application = ProtocolTypeRouter({"http": ASGIStaticFilesHandler(django_asgi), "websocket": websocket})

try:  # boards reconnect within seconds: the health check waits a heartbeat period from here before missing any
    liveness.listening()
except redis.RedisError as exc:  # the site's Redis down: its children's own checks say so; boards may be missed
    logging.getLogger(__name__).warning("could not note in Redis that this site listens: %s", exc)
