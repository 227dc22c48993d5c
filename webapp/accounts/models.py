"""Personal API tokens: `Authorization: Bearer TOKEN` for scripts; only the hash is stored."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from webapp.lib.tokens import new_token, token_hash

PREFIX = "ast_api"


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=64, default="script")
    token_hash = models.CharField(max_length=64, unique=True)
    hint = models.CharField(max_length=16, help_text="The token's first characters, to tell tokens apart.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

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
        row = cls.objects.select_related("user").filter(token_hash=token_hash(token)).first()
        if row is None or not row.user.is_active:
            return None
        now = timezone.now()
        if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:  # not one write per request
            cls.objects.filter(pk=row.pk).update(last_used_at=now)
        return row.user
