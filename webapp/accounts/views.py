"""The profile page: the user's API tokens (create, shown once; revoke); the page of a locked-out login."""

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.accounts.models import ApiToken


@login_required
def profile(request):
    token = None
    if request.method == "POST":
        name = request.POST.get("name", "").strip()[:64] or "script"
        _, token = ApiToken.issue(request.user, name)
    return render(request, "accounts/profile.html", {"tokens": request.user.api_tokens.all(), "new_token": token})


@login_required
@require_POST
def revoke(request, token_id: int):
    row = get_object_or_404(ApiToken, pk=token_id, user=request.user)
    row.delete()
    messages.info(request, f"Token {row.name!r} ({row.hint}…) is revoked.")
    return redirect("profile")


def locked_out(request, response=None, credentials=None):
    """What django-axes answers a login that it refused (AXES_LOCKOUT_CALLABLE): the login page, saying why, 429."""
    minutes = round(settings.AXES_COOLOFF_TIME.total_seconds() / 60)
    message = (
        f"Too many failed logins ({settings.AXES_FAILURE_LIMIT}) for this username from your address: logging in "
        f"is locked for {minutes} minutes. Try again later, or ask an administrator to unlock it."
    )
    form = AuthenticationForm(request)
    return render(request, "registration/login.html", {"form": form, "locked_out": message}, status=429)
