"""Admin for API tokens: list and revoke (tokens are created by their owner, who alone sees them)."""

from django.contrib import admin

from webapp.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("user", "name", "hint", "created_at", "last_used_at")
    readonly_fields = ("user", "name", "hint", "token_hash", "created_at", "last_used_at")

    def has_add_permission(self, request):
        return False
