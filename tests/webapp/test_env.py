"""Settings from the environment: helpers in webapp/env.py and what webapp.settings makes of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from webapp import env

ROOT = Path(__file__).resolve().parents[2]


def settings_in_subprocess(extra_env: dict, expr: str) -> subprocess.CompletedProcess:
    """Evaluate `expr` on freshly loaded settings in a clean process with `extra_env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL", "REDIS_URL"))}
    code = f"import json; from django.conf import settings; print(json.dumps({expr}, default=str))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "DJANGO_SETTINGS_MODULE": "webapp.settings", **extra_env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.multiprocess
def test_default_database_is_sqlite_under_var():
    out = settings_in_subprocess({}, "settings.DATABASES['default']")
    assert out.returncode == 0, out.stderr
    db = json.loads(out.stdout)
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == str(ROOT / "var" / "db.sqlite3")


def test_database_url_postgres_is_parsed():
    db = env.database_config("postgres://bob:pw@db.example:5433/asteroid")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["HOST"], db["PORT"], db["NAME"], db["USER"]) == ("db.example", 5433, "asteroid", "bob")


def test_postgres_connections_are_pooled_per_process_sqlite_never():
    db = env.database_config("postgres://bob@db.example/asteroid", pool_size=7)
    assert db["OPTIONS"]["pool"]["max_size"] == 7
    assert db["CONN_MAX_AGE"] == 0  # Django refuses a pool with persistent connections
    unpooled = env.database_config("postgres://bob@db.example/asteroid", pool_size=0)  # e.g. behind PgBouncer
    assert "pool" not in unpooled.get("OPTIONS", {}) and unpooled["CONN_MAX_AGE"] == 60
    assert "pool" not in env.database_config("sqlite:///x.db", pool_size=7).get("OPTIONS", {})


@pytest.mark.parametrize(
    "url, words",
    [
        ("mysqll://u@h/db", "unknown scheme 'mysqll'"),
        ("not a url", "is not a database URL"),
        ("postgres://u:secret@h:notaport/db", "is malformed"),
        ("postgres://u@h:5432/", "names no database"),
    ],
)
def test_bad_database_url_is_one_clear_line(url, words):
    with pytest.raises(ImproperlyConfigured) as exc:
        env.database_config(url)
    message = str(exc.value)
    assert words in message
    assert message.startswith("DATABASE_URL=")
    assert "sqlite:///PATH" in message  # says how to fix it
    assert "\n" not in message
    assert "secret" not in message  # passwords are redacted


@pytest.mark.multiprocess
def test_bad_database_url_stops_manage_py_without_traceback():
    out = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": "nosuchdb://x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.strip() == (
        "error: DATABASE_URL='nosuchdb://x' has unknown scheme 'nosuchdb'; "
        "use sqlite:///PATH or postgres://USER:PASSWORD@HOST:PORT/NAME"
    )


def test_env_bool(monkeypatch):
    monkeypatch.setenv("X_FLAG", "Off")
    assert env.env_bool("X_FLAG", True) is False
    monkeypatch.setenv("X_FLAG", "yes")
    assert env.env_bool("X_FLAG", False) is True
    monkeypatch.delenv("X_FLAG")
    assert env.env_bool("X_FLAG", True) is True
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match=r"X_FLAG='maybe' is not a boolean; use 1 or 0"):
        env.env_bool("X_FLAG", True)


def test_env_int_and_list(monkeypatch):
    monkeypatch.setenv("X_N", "12x")
    with pytest.raises(ImproperlyConfigured, match="X_N='12x' is not a whole number"):
        env.env_int("X_N", 1)
    monkeypatch.setenv("X_N", "-1")
    with pytest.raises(ImproperlyConfigured, match="X_N=-1 must be at least 0"):
        env.env_int("X_N", 1)
    monkeypatch.setenv("X_HOSTS", " a.example, ,b.example ")
    assert env.env_list("X_HOSTS", ["x"]) == ["a.example", "b.example"]


def test_env_seconds(monkeypatch):
    assert env.env_seconds("X_S", 3.8, minimum=0.5) == 3.8
    monkeypatch.setenv("X_S", "1.5")
    assert env.env_seconds("X_S", 3.8, minimum=0.5) == 1.5
    for bad, words in (("soon", "is not a number of seconds"), ("0.1", "at least 0.5"), ("nan", "at least 0.5"),
                       ("inf", "at least 0.5")):  # fmt: skip
        monkeypatch.setenv("X_S", bad)
        with pytest.raises(ImproperlyConfigured, match=words):
            env.env_seconds("X_S", 3.8, minimum=0.5)


def test_redis_url(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert env.redis_url() == ""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    assert env.redis_url() == "redis://127.0.0.1:6379/0"
    monkeypatch.setenv("REDIS_URL", "http://127.0.0.1:6379")
    with pytest.raises(ImproperlyConfigured, match="must start with redis://"):
        env.redis_url()
    monkeypatch.setenv("REDIS_URL", "redis://:pw@127.0.0.1:port/0")
    with pytest.raises(ImproperlyConfigured, match=r"REDIS_URL='redis://:\*\*\*@127.0.0.1:port/0' is malformed"):
        env.redis_url()


def test_dev_secret_key_is_generated_once_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    path = tmp_path / "var" / "secret_key"
    first = env.secret_key(True, path)
    assert len(first) >= 50
    assert env.secret_key(True, path) == first
    assert path.stat().st_mode & 0o777 == 0o600


def test_production_requires_secret_key(tmp_path, monkeypatch):
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SECRET_KEY must be set when DJANGO_DEBUG=0"):
        env.secret_key(False, tmp_path / "secret_key")
    assert not (tmp_path / "secret_key").exists()
    monkeypatch.setenv("DJANGO_SECRET_KEY", "k" * 60)
    assert env.secret_key(False, tmp_path / "secret_key") == "k" * 60


@pytest.mark.multiprocess
def test_production_settings_pass_check_deploy():
    out = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": "x7!pQ" * 12,
            "DJANGO_SECURE_HSTS_PRELOAD": "1",
            "DJANGO_ALLOWED_HOSTS": "asteroid.example",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


def test_env_port(monkeypatch):
    monkeypatch.delenv("X_PORT", raising=False)
    assert env.env_port("X_PORT", 8000) == 8000
    monkeypatch.setenv("X_PORT", " 8123 ")
    assert env.env_port("X_PORT", 8000) == 8123
    for bad in ("0", "65536", "http"):
        monkeypatch.setenv("X_PORT", bad)
        with pytest.raises(ImproperlyConfigured, match=rf"X_PORT='{bad}' is not a TCP port \(1-65535\)"):
            env.env_port("X_PORT", 8000)


def test_env_choice(monkeypatch):
    monkeypatch.delenv("X_PICK", raising=False)
    assert env.env_choice("X_PICK", "C", ["A", "B", "C"], "a letter") == "C"
    monkeypatch.setenv("X_PICK", "b")
    assert env.env_choice("X_PICK", "C", ["A", "B", "C"], "a letter") == "B"
    monkeypatch.setenv("X_PICK", "Off")
    assert env.env_choice("X_PICK", "C", ["A", "B", "C"], "a letter") is None
    monkeypatch.setenv("X_PICK", "Z")
    with pytest.raises(ImproperlyConfigured, match="X_PICK='Z' is not a letter; use one of A, B, C or none"):
        env.env_choice("X_PICK", "C", ["A", "B", "C"], "a letter")


def test_env_str_keeps_spaces_when_asked(monkeypatch):
    monkeypatch.setenv("X_SECRET", " pass word ")
    assert env.env_str("X_SECRET") == "pass word"
    assert env.env_str("X_SECRET", strip=False) == " pass word "


def test_env_dir_makes_the_folder_or_says_why_it_cannot(monkeypatch, tmp_path):
    monkeypatch.delenv("X_DIR", raising=False)
    assert env.env_dir("X_DIR", tmp_path / "a" / "b") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("X_DIR", str(tmp_path / "afile"))
    with pytest.raises(ImproperlyConfigured, match=r"^X_DIR='.*afile' is a file, not a folder; set it to a folder$"):
        env.env_dir("X_DIR", tmp_path)
    monkeypatch.setenv("X_DIR", str(tmp_path / "afile" / "sub"))
    with pytest.raises(ImproperlyConfigured, match=r"X_DIR='.*sub' cannot be created: Not a directory; set it to"):
        env.env_dir("X_DIR", tmp_path)
