"""Personal API tokens (`Authorization: Bearer TOKEN` for scripts) and invitations of new users; only hashes are
stored."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from webapp.lib.tokens import new_token, token_hash

PREFIX = "ast_api"


class _Hashed(models.Model):
    """A row a secret token finds, the token stored only as its hash; newest first."""

    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    @classmethod
    def by_token(cls, token: str) -> models.QuerySet:
        return cls.objects.filter(token_hash=token_hash(token))


class ApiToken(_Hashed):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=64, default="script")
    hint = models.CharField(max_length=16, help_text="The token's first characters, to tell tokens apart.")
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.user} · {self.name} ({self.hint}…)"

    @classmethod
    def issue(cls, user, name: str = "script") -> tuple[ApiToken, str]:
        """A new token for `user`; returns the row and the token itself, which is never stored or shown again."""
        token = new_token(PREFIX)
        row = cls.objects.create(user=user, name=name or "script", token_hash=token_hash(token), hint=token[:12])
        return row, token

    @classmethod
    def user_for(cls, token: str | None):
        """The active user a token belongs to, or None."""
        if not token:
            return None
        row = cls.by_token(token).select_related("user").first()
        if row is None or not row.user.is_active:
            return None
        now = timezone.now()
        if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:  # not one write per request
            cls.objects.filter(pk=row.pk).update(last_used_at=now)
        return row.user


INVITE_PREFIX = "ast_invite"
INVITE_DAYS = 7


class Invitation(_Hashed):
    """A one-time link for a new user to choose a username and password; only its hash is stored."""

    staff = models.BooleanField(default=False, help_text="The new user may add devices and act on every job.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    expires_at = models.DateTimeField()
    used_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")  # fmt: skip
    used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"invitation {self.pk} ({'used' if self.used_at else 'open'})"

    @property
    def open(self) -> bool:
        return self.used_at is None and self.expires_at > timezone.now()

    @classmethod
    def issue(cls, by, staff: bool = False) -> tuple[Invitation, str]:
        """A new invitation, valid for INVITE_DAYS; returns the row and its token, which is shown once."""
        token = new_token(INVITE_PREFIX)
        expires = timezone.now() + timezone.timedelta(days=INVITE_DAYS)
        row = cls.objects.create(token_hash=token_hash(token), staff=staff, created_by=by, expires_at=expires)
        return row, token

    @classmethod
    def find(cls, token: str) -> Invitation | None:
        """The open invitation of `token`, or None (unknown, used, expired)."""
        row = cls.by_token(token).first()
        return row if row is not None and row.open else None

    def accept(self, user) -> bool:
        """Mark it used by `user` (who gets staff status if it grants it); False if someone used it first."""
        claimed = type(self).objects.filter(pk=self.pk, used_at__isnull=True).update(used_at=timezone.now(),
                                                                                     used_by=user)  # fmt: skip
        if claimed and self.staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
        return bool(claimed)


class AlertSettings(models.Model):
    """How a user hears of their jobs' turns (webapp/jobs/alerts.py): by e-mail and/or a webhook, for the kinds
    ticked."""

    KINDS = ("completed", "failed", "recovered", "diverged")

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="alerts")
    email = models.BooleanField(default=False, help_text="E-mail the user's address (Django's mail settings).")
    webhook_url = models.URLField(blank=True, max_length=500, help_text="POSTed a JSON object per alert.")
    kinds = models.JSONField(default=list, blank=True, help_text="Which of completed, failed, recovered, diverged.")

    @classmethod
    def of(cls, user) -> AlertSettings:
        """The user's settings (unsaved defaults, every kind ticked and nothing on, when they never set any)."""
        found = cls.objects.filter(user=user).first()
        return found if found is not None else cls(user=user, kinds=list(cls.KINDS))
