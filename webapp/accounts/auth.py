"""Who may call a view: staff-only pages, and the JSON API's session (with CSRF on writes) or
`Authorization: Bearer API_TOKEN`."""

from __future__ import annotations

import json
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt

from webapp.accounts.models import ApiToken
from webapp.lib.tokens import bearer

SAFE = ("GET", "HEAD", "OPTIONS")
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def error(status: int, message: str) -> JsonResponse:
    """Every API error: `{"error": "one line"}` with an HTTP status."""
    return JsonResponse({"error": message}, status=status)


def json_object(body: bytes) -> dict:
    """A request body as a JSON object, or ValueError with the one line to answer."""
    try:
        doc = json.loads(body)
    # ValueError: malformed, not UTF-8, or an integer over Python's 4300 digits; RecursionError: nested too deep.
    except (ValueError, RecursionError):
        raise ValueError("the request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("the request body must be a JSON object")
    return doc


def _csrf_failure(request) -> bool:
    return CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {}) is not None


def staff_required(view):
    """Decorate a staff-only page: a visitor is sent to the site's login, a user who is not staff gets 403 (as
    the API answers), not Django admin's login."""

    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            raise PermissionDenied("only staff members may do this")
        return view(request, *args, **kwargs)

    return wrapper


def api(*methods: str, staff: bool = False):
    """Decorate an API view: allowed methods, who may call it, and `request.json` parsed for POST."""

    def decorate(view):
        @csrf_exempt  # checked below, only for cookie sessions: a bearer token cannot be sent by another site
        @wraps(view)
        def wrapper(request, *args, **kwargs):
            if request.method not in methods:
                return error(405, f"{request.method} is not allowed here; use {' or '.join(methods)}")
            token = bearer(request.headers.get("Authorization"))
            if token is not None:
                user = ApiToken.user_for(token)
                if user is None:
                    return error(401, "the API token is invalid or revoked; create one on your profile page")
                request.user = user
            elif not request.user.is_authenticated:
                return error(401, "log in, or send an API token as 'Authorization: Bearer TOKEN'")
            elif request.method not in SAFE and _csrf_failure(request):
                return error(403, "CSRF check failed: send the csrftoken cookie's value in an X-CSRFToken header")
            if staff and not request.user.is_staff:
                return error(403, "only staff members may do this")
            request.json = {}
            if request.method == "POST" and request.content_type in FORMS:
                request.json = request.POST.dict()  # `curl -d model=...` works too
            elif request.method == "POST" and request.body.strip():
                try:
                    request.json = json_object(request.body)
                except ValueError as exc:
                    return error(400, str(exc))
            return view(request, *args, **kwargs)

        return wrapper

    return decorate
