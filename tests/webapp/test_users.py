"""Users: staff invite by a one-time link, the invited choose a username and password; nobody else can."""

import re
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from webapp.accounts.models import Invitation

pytestmark = pytest.mark.django_db
NEW = {"username": "dana", "password1": "a long enough passphrase 7", "password2": "a long enough passphrase 7"}


def invite(client, staff=False) -> str:
    page = client.post("/users/", {"staff": "on"} if staff else {}).content.decode()
    return re.search(r'<pre class="command" id="invitation-link">([^<]+)</pre>', page).group(1)


def test_staff_invite_and_the_invited_choose_username_and_password(client, alice, settings):
    settings.ASTEROID_SITE_URL = "http://198.18.42.1:8000"
    client.force_login(alice)
    link = invite(client)
    assert link.startswith("http://198.18.42.1:8000/accounts/join/ast_invite_")
    token = link.rstrip("/").rsplit("/", 1)[1]
    assert token not in str(Invitation.objects.values()) and token not in client.get("/users/").content.decode()
    path = link.split("8000", 1)[1]
    newcomer = Client()
    assert "Choose a username and a password" in newcomer.get(path).content.decode()
    weak = newcomer.post(path, {**NEW, "password1": "123", "password2": "123"})
    assert weak.status_code == 200 and "too short" in weak.content.decode()  # Django's password validators
    joined = newcomer.post(path, NEW, follow=True)
    assert "Welcome, dana" in joined.content.decode()
    dana = get_user_model().objects.get(username="dana")
    assert not dana.is_staff and dana.check_password(NEW["password1"])
    assert newcomer.get("/jobs/").status_code == 200  # logged in
    again = Client().post(path, {**NEW, "username": "eve"})
    assert again.status_code == 404 and "already used or expired" in again.content.decode()
    assert not get_user_model().objects.filter(username="eve").exists()
    assert "dana" in client.get("/users/").content.decode()


def test_a_staff_invitation_makes_staff_and_an_expired_or_revoked_one_nothing(client, alice):
    client.force_login(alice)
    path = "/accounts/join/" + invite(client, staff=True).rstrip("/").rsplit("/", 1)[1] + "/"
    Client().post(path, NEW)
    assert get_user_model().objects.get(username="dana").is_staff
    expired = "/accounts/join/" + invite(client).rstrip("/").rsplit("/", 1)[1] + "/"
    Invitation.objects.filter(used_at__isnull=True).update(expires_at=timezone.now())
    assert Client().get(expired).status_code == 404
    revoked = "/accounts/join/" + invite(client).rstrip("/").rsplit("/", 1)[1] + "/"
    row = Invitation.objects.filter(used_at__isnull=True).latest("created_at")
    client.post(f"/users/invitations/{row.pk}/revoke/")
    assert Client().get(revoked).status_code == 404
    assert Client().get("/accounts/join/nonsense/").status_code == 404


def test_only_staff_see_users_and_invite(client, bob):
    client.force_login(bob)
    assert client.get("/users/").status_code == 403  # not for users
    assert client.post("/users/").status_code == 403 and not Invitation.objects.exists()
    assert Client().get("/users/")["Location"] == "/accounts/login/?next=/users/"


def test_the_invite_command_prints_a_link(alice):
    out = StringIO()
    call_command("invite", "--staff", stdout=out)
    link = out.getvalue().strip().splitlines()[-1]
    assert "/accounts/join/ast_invite_" in link
    assert Invitation.objects.get().staff and Invitation.objects.get().created_by == alice


def test_a_refused_request_is_one_line_in_the_log_once(client, bob, caplog):
    """Another user's job is a 404, a staff page a 403: each one line (no traceback), printed once."""
    import logging

    client.force_login(bob)
    caplog.set_level(logging.WARNING, logger="django.request")
    assert client.get("/jobs/999999/").status_code == 404
    assert client.post("/api/devices/", {}, content_type="application/json").status_code in (403, 400)
    refused = [r for r in caplog.records if r.name == "django.request"]
    assert refused and all(r.exc_info is None and r.exc_text is None for r in refused)
    assert not logging.getLogger("django").handlers and logging.getLogger("django").propagate


def test_a_page_that_is_not_there_is_the_sites_404_even_under_debug(client, bob, carol, settings):
    """Issue 52, defect 6: another user's job showed DEBUG's 404 page, which lists every URL pattern of the site."""
    from webapp.jobs.models import Job

    settings.DEBUG = True  # make run's default
    job = Job.objects.create(owner=bob, model="mobilenetv2")
    client.force_login(carol)
    for path, reason in ((f"/jobs/{job.pk}/", f"No job {job.pk} of yours"), ("/nowhere/x", "No page at /nowhere/x")):
        page = client.get(path)
        text = page.content.decode()
        assert page.status_code == 404 and reason in text, text[:300]
        assert "URLconf" not in text and "jobs/&lt;int:job_id&gt;" not in text and "<h1>Not found</h1>" in text
    assert client.get("/jobs?page=2")["Location"] == "/jobs/?page=2"  # a missing slash still finds the page
    assert client.post(f"/jobs/{job.pk}/cancel").status_code == 404  # (a form's body is not redirected away)
    assert client.get("/api/nowhere/").json()["error"].startswith("no API endpoint")  # the API's stay JSON


def test_a_page_asked_with_the_wrong_method_says_which_it_takes(client, bob):
    """Found trying it: GET on a POST-only page answered an empty 405."""
    client.force_login(bob)
    page = client.get("/jobs/1/archive/")
    text = page.content.decode()
    assert page.status_code == 405 and page["Allow"] == "POST"
    assert (
        "<h1>Not allowed</h1>" in text
        and "/jobs/1/archive/ takes POST (a button on the site&#x27;s pages), not GET" in text
    )
    assert client.get("/api/jobs/1/launch/").json()["error"].startswith("GET is not allowed here")  # the API's JSON
