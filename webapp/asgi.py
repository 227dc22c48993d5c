"""ASGI entry point served by daphne: HTTP (with static files) now; WebSocket routes join the router here."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
django_asgi = get_asgi_application()  # before importing anything that touches models

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

# One daphne process serves everything, static files included (from the finders, no collectstatic needed).
application = ProtocolTypeRouter({"http": ASGIStaticFilesHandler(django_asgi)})
