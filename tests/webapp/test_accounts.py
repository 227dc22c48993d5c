"""API tokens: `manage.py createtoken`, the profile page, revocation."""

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from webapp.accounts.models import ApiToken


def test_createtoken_prints_the_token_last(bob, capsys):
    call_command("createtoken", "bob")
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert token.startswith("ast_api_") and ApiToken.user_for(token) == bob
    assert Client().get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200


def test_createtoken_unknown_user(db):
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("createtoken", "nobody")


def test_profile_creates_shows_once_and_revokes(client, bob, carol):
    client.force_login(bob)
    page = client.post("/profile/", {"name": "ci"}).content.decode()
    row = ApiToken.objects.get(user=bob)
    token = page.split('id="new-token">')[1].split("<")[0]
    assert ApiToken.user_for(token) == bob and row.name == "ci"
    assert token not in client.get("/profile/").content.decode()
    client.force_login(carol)
    assert client.post(f"/profile/tokens/{row.pk}/revoke/").status_code == 404  # not hers
    client.force_login(bob)
    client.post(f"/profile/tokens/{row.pk}/revoke/")
    assert ApiToken.user_for(token) is None
