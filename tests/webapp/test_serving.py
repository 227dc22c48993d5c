"""Serving a lab (docs/deployment.md): ASTEROID_HOST and ASTEROID_SITE_URL, the hosts the site answers to, and a
disallowed host said as such (regression: it read like a bad enrollment token)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from webapp.env import env_host, site_url

ROOT = Path(__file__).resolve().parents[2]


def settings_in(**env) -> dict:
    """Some settings as a fresh process reads them from `env`."""
    code = (
        "from django.conf import settings as s; import json; print(json.dumps({k: getattr(s, k) for k in "
        "('ASTEROID_HOST', 'ASTEROID_SITE_URL', 'ALLOWED_HOSTS', 'ASTEROID_STORE_HOST', 'ASTEROID_STORE_PORT', "
        "'ASTEROID_TLS', 'DEBUG')}))"
    )
    out = settings_run(code, env)
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout)


def settings_run(code: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ASTEROID_", "DJANGO_ALLOWED", "DJANGO_DEBUG"))}
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=ROOT,
        env={**base, "DJANGO_SETTINGS_MODULE": "webapp.settings", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_site_follows_asteroid_host():
    s = settings_in(ASTEROID_HOST="198.18.42.1", ASTEROID_PORT="8123")
    assert s["ASTEROID_SITE_URL"] == "https://198.18.42.1:8123"  # a LAN address: TLS unless told otherwise
    assert "198.18.42.1" in s["ALLOWED_HOSTS"] and "127.0.0.1" in s["ALLOWED_HOSTS"]
    assert (s["ASTEROID_STORE_HOST"], s["ASTEROID_STORE_PORT"]) == ("198.18.42.1", 8124)


def test_defaults_serve_loopback():
    s = settings_in()
    assert s["ASTEROID_SITE_URL"] == "http://127.0.0.1:8000" and s["ASTEROID_STORE_HOST"] == "127.0.0.1"
    assert s["DEBUG"] and not s["ASTEROID_TLS"]


def test_a_lan_site_is_production_by_default_and_debug_there_is_refused_unless_meant(tmp_path):
    lan = {"ASTEROID_HOST": "198.18.42.1", "ASTEROID_VAR_DIR": str(tmp_path)}
    s = settings_in(**lan)  # no DJANGO_SECRET_KEY needed: one is kept in the var dir, as in development
    assert s["ASTEROID_TLS"] and not s["DEBUG"]
    out = settings_run("print(1)", {**lan, "DJANGO_DEBUG": "1"})
    assert out.returncode != 0 and "ASTEROID_DEBUG_ON_LAN=1 if you mean it" in out.stderr
    assert settings_in(**lan, DJANGO_DEBUG="1", ASTEROID_DEBUG_ON_LAN="1")["DEBUG"]
    plain = settings_in(**lan, ASTEROID_TLS="0")  # plain HTTP only when the administrator says so
    assert plain["ASTEROID_SITE_URL"] == "http://198.18.42.1:8000" and not plain["ASTEROID_TLS"]


def test_a_site_url_behind_a_proxy_is_allowed_too():
    s = settings_in(ASTEROID_HOST="0.0.0.0", ASTEROID_SITE_URL="https://asteroid.lab.example/")
    assert s["ASTEROID_SITE_URL"] == "https://asteroid.lab.example"
    assert "asteroid.lab.example" in s["ALLOWED_HOSTS"] and "0.0.0.0" not in s["ALLOWED_HOSTS"]


def test_host_settings_are_checked(monkeypatch):
    monkeypatch.setenv("ASTEROID_HOST", "not a host!")
    with pytest.raises(ImproperlyConfigured, match="is not an IP address or a host name"):
        env_host("ASTEROID_HOST", "127.0.0.1")
    monkeypatch.setenv("ASTEROID_HOST", "[fd00::1]")
    assert env_host("ASTEROID_HOST", "127.0.0.1") == "fd00::1"
    assert site_url("fd00::1", 8000) == "http://[fd00::1]:8000"
    with pytest.raises(ImproperlyConfigured, match="set ASTEROID_SITE_URL=http://LAN-ADDRESS:8000"):
        site_url("0.0.0.0", 8000)
    monkeypatch.setenv("ASTEROID_SITE_URL", "ftp://x")
    with pytest.raises(ImproperlyConfigured, match="must be an http"):
        site_url("127.0.0.1", 8000)


def test_startsite_help_prints_and_starts_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "webapp.startsite", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "ASTEROID_HOST" in out.stdout and "Asteroid is running" not in out.stdout


def test_an_address_not_of_this_machine_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(ASTEROID_HOST="198.18.250.250", ASTEROID_VAR_DIR=str(tmp_path), ASTEROID_CLUSTER="none")
    out = subprocess.run(
        [sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: ASTEROID_HOST=198.18.250.250 is not an address of this machine; use one that `ip addr` lists"
    )


@pytest.mark.django_db
def test_a_disallowed_host_says_so_on_the_api(client):
    # regression: the agent said "the server refused the enrollment token ... wrong or already used"
    response = client.post(
        "/api/agent/enroll/", {"token": "x"}, content_type="application/json", HTTP_HOST="198.18.42.1:8000"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "does not answer to the host '198.18.42.1:8000'" in error and "DJANGO_ALLOWED_HOSTS" in error
