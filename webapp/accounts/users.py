"""Users: staff list them and invite new ones by a one-time link; the invited choose a username and password."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model, login
from django.contrib.auth.forms import UserCreationForm
from django.db import transaction
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from webapp.accounts.auth import staff_required
from webapp.accounts.models import INVITE_DAYS, Invitation


def invitation_link(token: str) -> str:
    """The link to hand the new user: on the site's configured URL, as the boards' enrollment line is."""
    return settings.ASTEROID_SITE_URL.rstrip("/") + reverse("join", args=[token])


@staff_required
def users(request):
    link = None
    if request.method == "POST":
        staff = request.POST.get("staff") == "on"
        _, token = Invitation.issue(request.user, staff)
        link = invitation_link(token)
    people = get_user_model().objects.annotate(job_count=Count("jobs")).order_by("username")
    open_invitations = [i for i in Invitation.objects.filter(used_at__isnull=True) if i.open]
    context = {"people": people, "invitations": open_invitations, "link": link, "days": INVITE_DAYS}
    return render(request, "accounts/users.html", context)


@staff_required
@require_POST
def revoke_invitation(request, invitation_id: int):
    row = get_object_or_404(Invitation, pk=invitation_id, used_at__isnull=True)
    row.delete()
    messages.info(request, f"Invitation {invitation_id} is revoked: its link no longer works.")
    return redirect("users")


def join(request, token: str):
    """An invited person picks a username and password; then they are logged in."""
    invitation = Invitation.find(token)
    if invitation is None:
        message = "This invitation link is unknown, already used or expired: ask an administrator for a new one."
        return render(request, "accounts/join.html", {"invalid": message}, status=404)
    form = UserCreationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            user = form.save()
            if not invitation.accept(user):  # used by someone else a moment ago
                transaction.set_rollback(True)
                message = "This invitation was used a moment ago: ask an administrator for a new one."
                return render(request, "accounts/join.html", {"invalid": message}, status=409)
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        messages.success(request, f"Welcome, {user.get_username()}: your account is ready.")
        return redirect("home")
    return render(request, "accounts/join.html", {"form": form, "invitation": invitation})
