"""Accounts: API tokens (`manage.py createtoken`, the profile page, revocation) and login throttling."""

import logging

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from webapp.accounts.models import ApiToken

from .conftest import PASSWORD


def test_createtoken_prints_the_token_last(bob, capsys):
    call_command("createtoken", "bob")
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert token.startswith("ast_api_") and ApiToken.user_for(token) == bob
    assert Client().get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200


def test_createtoken_unknown_user(db):
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("createtoken", "nobody")


@pytest.mark.parametrize("name", ["x" * 65, " "])
def test_createtoken_refuses_a_name_the_column_cannot_hold(bob, name):
    with pytest.raises(CommandError, match="--name must be 1 to 64 characters"):
        call_command("createtoken", "bob", "--name", name)
    assert not ApiToken.objects.exists()


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


def test_five_wrong_passwords_lock_the_login_and_are_logged(client, bob, caplog):
    from axes.models import AccessAttempt, AccessFailureLog

    caplog.set_level(logging.WARNING, logger="axes")
    for attempt in range(1, 5):
        wrong = client.post("/accounts/login/", {"username": "bob", "password": f"guess {attempt}"})
        assert wrong.status_code == 200 and b"didn't match" in wrong.content
    assert any("login failure" in r.getMessage() and "bob" in r.getMessage() for r in caplog.records)
    fifth = client.post("/accounts/login/", {"username": "bob", "password": "guess 5"})
    assert fifth.status_code == 429 and b"locked for 15 minutes" in fifth.content
    right = client.post("/accounts/login/", {"username": "bob", "password": PASSWORD})
    assert right.status_code == 429 and "_auth_user_id" not in client.session
    assert "Too many failed logins (5) for this username from your address" in right.content.decode()
    assert AccessAttempt.objects.get(username="bob").failures_since_start >= 5
    assert AccessFailureLog.objects.filter(username="bob").count() >= 5
    # Only the password login is locked: bob's API token still works, and another user logs in.
    _, token = ApiToken.issue(bob)
    assert Client().get("/api/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    get_user_model().objects.create_user("dave", "dave@example.com", PASSWORD)
    other = Client().post("/accounts/login/", {"username": "dave", "password": PASSWORD})
    assert other.status_code == 302


def test_a_success_clears_the_failures(client, bob):
    for _ in range(4):
        client.post("/accounts/login/", {"username": "bob", "password": "nope"})
    assert client.post("/accounts/login/", {"username": "bob", "password": PASSWORD}).status_code == 302
    client.logout()
    for _ in range(4):
        assert client.post("/accounts/login/", {"username": "bob", "password": "nope"}).status_code == 200
    assert client.post("/accounts/login/", {"username": "bob", "password": PASSWORD}).status_code == 302


STAFF_PAGES = [("get", "/devices/add/"), ("post", "/devices/1/token/"), ("post", "/devices/1/disable/"),
               ("post", "/devices/1/enable/"), ("post", "/devices/1/remove/"), ("get", "/users/"),
               ("post", "/users/invitations/1/revoke/"), ("post", "/jobs/1/devices/kill/")]  # fmt: skip


@pytest.mark.parametrize("method, path", STAFF_PAGES)
def test_staff_pages_refuse_a_user_with_403_and_send_a_visitor_to_the_login(client, bob, method, path):
    # regression: both were sent to Django admin's login page (302 /admin/login/), a user as if logged out
    assert getattr(Client(), method)(path)["Location"] == f"/accounts/login/?next={path}"
    client.force_login(bob)
    refused = getattr(client, method)(path)
    assert refused.status_code == 403 and "Only staff members may do this." in refused.content.decode()
