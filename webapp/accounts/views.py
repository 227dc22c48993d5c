"""The profile page: the user's API tokens (create, shown once; revoke)."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
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
