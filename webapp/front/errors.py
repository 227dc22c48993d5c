"""The site's own "not found" page (and one for a request of the wrong method), DEBUG or not: a page's 404 says
what was not found (another user's job is "no job 7 of yours") and never shows Django's debug page, which lists
every URL pattern of the site."""

from __future__ import annotations

from django.http import Http404, HttpResponsePermanentRedirect
from django.shortcuts import render
from django.urls import Resolver404, resolve

from webapp.accounts.api_errors import PREFIX


def page_not_found(request, reason: str):
    return render(request, "404.html", {"reason": reason}, status=404)


def not_found(request):
    """The last route: a path no page has. A path missing its final slash goes to the page it names, as Django's
    APPEND_SLASH would (this route leaves it nothing to redirect); a form sent there (its body would be lost in
    a redirect) is told the path."""
    if not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
        except Resolver404:
            match = None
        if match is not None and match.func is not not_found:
            if request.method not in ("GET", "HEAD"):
                return page_not_found(request, f"no page at {request.path}; the site's paths end in a slash")
            query = request.META.get("QUERY_STRING", "")
            return HttpResponsePermanentRedirect(request.path + "/" + (f"?{query}" if query else ""))
    return page_not_found(request, f"no page at {request.path}")


class PageErrors:
    """Middleware: a page's Http404 (an unknown or another user's job, device or model) is the site's 404 page with
    its reason. The API's are JSON (webapp.accounts.api_errors)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.status_code == 405 and not response.content and not request.path.startswith(PREFIX):
            allowed = response.get("Allow", "")  # Django's bare 405 (require_POST): a page that says what to do
            takes = allowed.replace(", ", " or ")
            reason = f"{request.path} takes {takes} (a button on the site's pages), not {request.method}"
            page = render(request, "404.html", {"reason": reason, "title": "Not allowed"}, status=405)
            page["Allow"] = allowed
            return page
        return response

    def process_exception(self, request, exc):
        if isinstance(exc, Http404) and not request.path.startswith(PREFIX):
            return page_not_found(request, str(exc) or "not found")
        return None
