"""Every error under /api/ as `{"error": "one line"}` JSON, whatever raised it: a view, Django or the URL resolver."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import DisallowedHost, PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.http import Http404
from django.urls import resolve
from django.views.decorators.csrf import csrf_exempt

from webapp.accounts.auth import error

PREFIX = "/api/"


@csrf_exempt  # a POST to no endpoint is a 404, not a CSRF failure
def not_found(request):
    """The last /api/ route: an unknown path is a JSON 404 rather than a redirect to the slash (a POST would lose
    its body there) or an HTML page."""
    line = f"no API endpoint at {request.path}"
    if not request.path.endswith("/") and resolve(request.path + "/").func is not not_found:
        return error(404, f"{line}; the API's paths end in a slash: {request.path}/")
    return error(404, f"{line}; see README 'JSON API and sockets'")


def disallowed_host(request) -> str:
    host = request.META.get("HTTP_HOST", "")[:100]
    return (
        f"this site does not answer to the host {host!r}: reach it at {settings.ASTEROID_SITE_URL}, or add "
        f"{host.rsplit(':', 1)[0] if host.count(':') == 1 else host!r} to DJANGO_ALLOWED_HOSTS on the site"
    )


class ApiErrors:
    """Middleware, first in MIDDLEWARE: the exceptions that Django answers with an HTML page (404, a body over
    DATA_UPLOAD_MAX_MEMORY_SIZE, 403, 400) become JSON with their message; any other non-JSON error response of an
    /api/ path (a bare 405 from require_POST, a 500) becomes JSON with its status."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith(PREFIX):
            try:
                request.get_host()
            except DisallowedHost:  # Django's own answer is a bare "bad request": say which host and what to do
                return error(400, disallowed_host(request))
        response = self.get_response(request)
        if not request.path.startswith(PREFIX) or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        if response.status_code == 405:
            allowed = response.get("Allow", "")
            return error(405, f"{request.method} is not allowed here; use {allowed.replace(', ', ' or ')}")
        if response.status_code >= 500:
            return error(response.status_code, "the server failed on this request; the error is in its log")
        return error(response.status_code, response.reason_phrase.lower())

    def process_exception(self, request, exc):
        if not request.path.startswith(PREFIX):
            return None
        if isinstance(exc, Http404):
            return error(404, str(exc) or "not found")
        if isinstance(exc, RequestDataTooBig):
            return error(413, f"the request body is over the limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes")
        if isinstance(exc, PermissionDenied):
            return error(403, str(exc) or "permission denied")
        if isinstance(exc, SuspiciousOperation):  # too many fields, a malformed multipart body
            return error(400, str(exc) or "bad request")
        return None  # a bug: Django logs it and answers 500, made JSON by __call__
