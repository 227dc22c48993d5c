"""WebSocket auth for browsers and scripts: a same-origin session, or `Authorization: Bearer API_TOKEN`.

Browsers go through the origin check and the session (AllowedHostsOriginValidator → AuthMiddlewareStack).
A script sends no Origin and no cookie: a valid API token sets the user instead (a token is not ambient
like a cookie, so another site cannot make a browser send it). A bad token leaves the user anonymous.
"""

from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser

from webapp.accounts.models import ApiToken
from webapp.lib.tokens import bearer


class SessionOrToken:
    def __init__(self, inner):
        self.inner = inner
        self.browser = AllowedHostsOriginValidator(AuthMiddlewareStack(inner))

    async def __call__(self, scope, receive, send):
        header = dict(scope.get("headers", [])).get(b"authorization")
        token = bearer(header.decode("latin-1")) if header else None
        if token is None:
            return await self.browser(scope, receive, send)
        user = await database_sync_to_async(ApiToken.user_for)(token)
        return await self.inner({**scope, "user": user or AnonymousUser()}, receive, send)
