"""The home page: login required, shows registered devices and the engine's built-in clusters."""

import pytest
from django.urls import reverse

from engine.devices import CLUSTERS
from webapp.devices.models import Device

from .conftest import PASSWORD


def test_anonymous_is_redirected_to_login(client, db):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/"


def test_login_page_renders_and_logs_in(client, bob):
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    assert b'name="username"' in page.content and b'name="password"' in page.content

    wrong = client.post("/accounts/login/", {"username": "bob", "password": "nope"})
    assert wrong.status_code == 200
    assert b"didn't match" in wrong.content

    right = client.post("/accounts/login/?next=/", {"username": "bob", "password": PASSWORD, "next": "/"})
    assert right.status_code == 302 and right["Location"] == "/"
    assert client.get("/").status_code == 200


def test_home_lists_devices_and_builtin_clusters(client, bob):
    Device.objects.create(name="nx-lab-1", kind="jetson-xavier-nx", status=Device.Status.ONLINE)
    Device.objects.create(name="rig-9", kind="custom", memory_gb=16, gflops=5000)
    client.force_login(bob)
    html = client.get("/").content.decode()
    assert "nx-lab-1" in html and "Jetson Xavier NX" in html and "Online" in html
    assert "rig-9" in html and "Custom" in html
    for letter, cluster in CLUSTERS.items():
        assert f"<strong>{letter}</strong>" in html
        for device in cluster.devices:
            assert device.name in html
    assert "1× Jetson Xavier NX + 2× Jetson TX2 + 3× Jetson Nano" in html  # cluster C
    assert "5× Jetson Nano" in html  # cluster A


def test_home_with_no_devices_says_so(client, bob):
    client.force_login(bob)
    html = client.get("/").content.decode()
    assert "No devices registered yet." in html
    assert f'href="{reverse("admin:index")}"' not in html  # bob is not staff


def test_staff_sees_admin_link(client, alice):
    client.force_login(alice)
    html = client.get("/").content.decode()
    assert f'href="{reverse("admin:index")}"' in html


@pytest.mark.parametrize("method", ["post"])
def test_logout_is_a_post(client, bob, method):
    client.force_login(bob)
    assert client.get("/accounts/logout/").status_code == 405
    response = getattr(client, method)("/accounts/logout/")
    assert response.status_code == 302 and response["Location"] == "/accounts/login/"
    assert client.get("/").status_code == 302


def test_static_css_is_served_by_the_asgi_app():
    from asgiref.sync import async_to_sync
    from asgiref.testing import ApplicationCommunicator

    from webapp.asgi import application

    async def get(path):
        scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}
        app = ApplicationCommunicator(application, scope)
        await app.send_input({"type": "http.request", "body": b""})
        start = await app.receive_output(5)
        body = b""
        while True:  # a file response may end with a body message that carries no bytes
            message = await app.receive_output(5)
            body += message.get("body", b"")
            if not message.get("more_body"):
                return start["status"], body

    status, body = async_to_sync(get)("/static/css/site.css")
    assert status == 200
    assert b".topbar" in body
    status, body = async_to_sync(get)("/static/vendor/plotly/plotly.min.js")  # from the plotly package, no CDN
    assert status == 200
    assert b"plotly.js" in body[:2000]


def test_the_favicon_is_served(client):
    from django.contrib.staticfiles import finders

    response = client.get("/favicon.ico")
    assert response.status_code == 302 and response["Location"] == "/static/favicon.svg"
    assert finders.find("favicon.svg")  # what the site's static handler serves there
