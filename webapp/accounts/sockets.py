"""WebSocket auth for browsers and scripts: a same-origin session, or `Authorization: Bearer API_TOKEN`.

Browsers go through the origin check and the session (SameOrigin → AuthMiddlewareStack). A script sends no
Origin and no cookie: a valid API token sets the user instead (a token is not ambient like a cookie, so another
site cannot make a browser send it). A bad token leaves the user anonymous.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import split_domain_port, validate_host

from webapp.accounts.models import ApiToken
from webapp.lib.tokens import bearer

DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_key(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as `http://127.0.0.1:8000`, the port filled in; None if it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:  # a port that is not a number
        return None
    if not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname, port


def _secure(scope, headers: dict[bytes, bytes]) -> bool:
    """wss, or https at a TLS-terminating proxy that says so in the header Django trusts (SECURE_PROXY_SSL_HEADER)."""
    if scope.get("scheme") == "wss":
        return True
    trusted = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if not trusted:
        return False
    name, value = trusted  # ("HTTP_X_FORWARDED_PROTO", "https")
    sent = headers.get(name.removeprefix("HTTP_").lower().replace("_", "-").encode(), b"").decode("latin-1")
    return sent.split(",", 1)[0].strip() == value


def same_origin(scope) -> bool:
    """Whether a browser's handshake comes from this site's own pages: its Origin has the scheme, host AND port of
    the Host header it was sent with (a host in ALLOWED_HOSTS), or is one of CSRF_TRUSTED_ORIGINS (behind a proxy),
    as Django's CSRF check decides for a form. A page on another port of the same host is another origin."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin", b"").decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    if not origin or not host or not validate_host(split_domain_port(host)[0], allowed):
        return False
    if origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    ours = _origin_key(f"{'https' if _secure(scope, headers) else 'http'}://{host}")
    return ours is not None and _origin_key(origin) == ours


class SameOrigin:
    """ASGI middleware: refuses the handshake (HTTP 403) of a socket whose Origin is not this site."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if not same_origin(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.inner(scope, receive, send)


class SessionOrToken:
    def __init__(self, inner):
        self.inner = inner
        self.browser = SameOrigin(AuthMiddlewareStack(inner))

    async def __call__(self, scope, receive, send):
        header = dict(scope.get("headers", [])).get(b"authorization")
        token = bearer(header.decode("latin-1")) if header else None
        if token is None:
            return await self.browser(scope, receive, send)
        user = await database_sync_to_async(ApiToken.user_for)(token)
        return await self.inner({**scope, "user": user or AnonymousUser()}, receive, send)
