"""The profile page: the user's API tokens (create, shown once; revoke) and alerts; a locked-out login's page."""

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.accounts.models import AlertSettings, ApiToken


class AlertsForm(forms.ModelForm):
    """Where a user's job alerts go (webapp/jobs/alerts.py), and their e-mail address."""

    address = forms.EmailField(required=False, label="E-mail address", max_length=254)
    webhook_url = forms.URLField(required=False, max_length=500, assume_scheme="https", label="Webhook URL")
    kinds = forms.MultipleChoiceField(
        choices=[(k, k) for k in AlertSettings.KINDS],
        widget=forms.CheckboxSelectMultiple,
        required=False,
        label="Tell me when a job",
        help_text="Diverged: its loss is not a number, or its held-out loss is past chance's.",
    )

    class Meta:
        model = AlertSettings
        fields = ("email", "webhook_url", "kinds")
        labels = {"email": "By e-mail", "webhook_url": "Webhook URL"}

    def clean(self):
        data = super().clean()
        if data.get("email") and not data.get("address"):
            self.add_error("address", "Give the address to e-mail, or untick e-mail.")
        url = data.get("webhook_url") or ""
        if url and not url.startswith(("http://", "https://")):
            self.add_error("webhook_url", "An http:// or https:// URL.")
        return data


@login_required
def profile(request):
    token = None
    settings_row = AlertSettings.of(request.user)
    alerts = AlertsForm(instance=settings_row, initial={"address": request.user.email})
    if request.method == "POST" and request.POST.get("form") == "alerts":
        alerts = AlertsForm(request.POST, instance=settings_row)
        if alerts.is_valid():
            alerts.save()
            request.user.email = alerts.cleaned_data["address"]
            request.user.save(update_fields=["email"])
            messages.success(request, "Alerts saved.")
            return redirect("profile")
    elif request.method == "POST":
        name = request.POST.get("name", "").strip()[:64] or "script"
        _, token = ApiToken.issue(request.user, name)
    context = {
        "tokens": request.user.api_tokens.all(),
        "new_token": token,
        "alerts": alerts,
        "mail_configured": bool(settings.EMAIL_HOST),
    }
    return render(request, "accounts/profile.html", context)


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
