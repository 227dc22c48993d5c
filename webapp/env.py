"""Typed readers for settings from the environment: each bad value raises ImproperlyConfigured with one clear line."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from webapp.lib.files import write_once

LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"(?=.{{1,253}}$){LABEL}(\.{LABEL})*")
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def env_str(name: str, default: str = "", strip: bool = True) -> str:
    """The variable's value stripped of surrounding spaces (unless `strip` is False: a password keeps its spaces),
    or `default` when unset or empty."""
    value = os.environ.get(name, "")
    return (value.strip() if strip else value) or default


def env_bool(name: str, default: bool) -> bool:
    """A boolean written as 1/0, true/false, yes/no or on/off (any case)."""
    value = env_str(name).lower()
    if not value:
        return default
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean; use 1 or 0 (also true/false, yes/no, on/off)")


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """A whole number of at least `minimum`."""
    return _env_number(name, default, int, "a whole number", minimum, "must be at least")


def env_seconds(name: str, default: float, minimum: float) -> float:
    """A number of seconds (a decimal point allowed) of at least `minimum`."""
    return _env_number(name, default, float, "a number of seconds", minimum, "must be a number of seconds, at least")


def _env_number(name: str, default, read, what: str, minimum, too_small: str):
    """`read` (int or float) of the value, finite and at least `minimum`; `default` when unset or empty."""
    value = env_str(name)
    if not value:
        return default
    try:
        number = read(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not {what}") from None
    if not minimum <= number < float("inf"):
        raise ImproperlyConfigured(f"{name}={value} {too_small} {minimum}")
    return number


def env_port(name: str, default: int) -> int:
    """A TCP port, 1-65535."""
    value = env_str(name, str(default))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ImproperlyConfigured(f"{name}={value!r} is not a TCP port (1-65535)")
    return int(value)


def env_choice(name: str, default: str, choices: Sequence[str], what: str) -> str | None:
    """One of `choices`, written in any case, as spelled in `choices`; None for none, 0 or off."""
    value = env_str(name, default)
    if value.lower() in ("none", "0", "off"):
        return None
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    raise ImproperlyConfigured(f"{name}={value!r} is not {what}; use one of {', '.join(choices)} or none")


WILDCARDS = ("0.0.0.0", "::")


def env_host(name: str, default: str) -> str:
    """An address to listen on: an IPv4 or IPv6 address or a host name (0.0.0.0 and :: listen on every interface)."""
    value = env_str(name, default)
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if not HOSTNAME.fullmatch(value):
        raise ImproperlyConfigured(f"{name}={value!r} is not an IP address or a host name (e.g. 192.168.1.10)")
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (127.0.0.0/8, ::1, localhost): nothing on a LAN can reach it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def lab_certificate() -> tuple[str, str, str] | None:
    """The lab's own certificate, key and CA (ASTEROID_TLS_CERT, ASTEROID_TLS_KEY, ASTEROID_TLS_CA: all three or
    none), each a readable file, or None for the site's own CA (webapp/sitetls.py)."""
    names = ("ASTEROID_TLS_CERT", "ASTEROID_TLS_KEY", "ASTEROID_TLS_CA")
    given = [env_str(n) for n in names]
    if not any(given):
        return None
    missing = [n for n, v in zip(names, given, strict=True) if not v]
    if missing:
        raise ImproperlyConfigured(
            f"{', '.join(missing)} must be set too: the lab's own certificate takes its key and the CA that signed it "
            "(boards pin that CA); or unset all three for the site's own CA"
        )
    for n, v in zip(names, given, strict=True):
        if not os.access(v, os.R_OK):
            raise ImproperlyConfigured(f"{n}={v} is not a file this process can read")
    return given[0], given[1], given[2]


def url_host(host: str) -> str:
    """`host` as it is written in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def site_url(host: str, port: int, name: str = "ASTEROID_SITE_URL", scheme: str = "http") -> str:
    """The URL boards and people reach the site at: `name` when set, else SCHEME://HOST:PORT. A site listening on
    every interface (0.0.0.0) has no one address to tell the boards, so `name` is required then."""
    value = env_str(name).rstrip("/")
    if not value:
        if host in WILDCARDS:
            raise ImproperlyConfigured(
                f"ASTEROID_HOST={host} listens on every interface, but the boards need one address to reach the site: "
                f"set {name}={scheme}://LAN-ADDRESS:{port}"
            )
        return f"{scheme}://{url_host(host)}:{port}"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is malformed (check the port)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ImproperlyConfigured(f"{name}={value!r} must be an http(s) URL such as http://192.168.1.10:8000")
    return value


def env_dir(name: str, default: Path) -> Path:
    """A folder this process can write in, created (with its parents) when missing."""
    path = Path(env_str(name) or default)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ImproperlyConfigured(f"{name}={str(path)!r} is a file, not a folder; set it to a folder") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ImproperlyConfigured(
            f"{name}={str(path)!r} cannot be created: {why}; set it to a writable folder"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ImproperlyConfigured(f"{name}={str(path)!r} is not writable by this user; set it to a writable folder")
    return path


def env_list(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; blank items are dropped."""
    value = env_str(name)
    if not value:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def redact(url: str) -> str:
    """The URL with its password replaced by ***, safe to print in an error."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparseable URL>"


def database_config(url: str, name: str = "DATABASE_URL", pool_size: int = 0) -> dict:
    """Django's DATABASES['default'] for a database URL such as sqlite:///var/db.sqlite3 or postgres://u@host/db.
    PostgreSQL with `pool_size` > 0: each process keeps at most that many connections in a psycopg pool, and a
    thread's connection goes back to it when closed (0: no pool, each thread holds a connection of its own)."""
    hint = "use sqlite:///PATH or postgres://USER:PASSWORD@HOST:PORT/NAME"
    if "://" not in url:
        raise ImproperlyConfigured(f"{name}={redact(url)!r} is not a database URL; {hint}")
    try:
        config = dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except dj_database_url.UnknownSchemeError:
        scheme = url.split("://", 1)[0]
        raise ImproperlyConfigured(f"{name}={redact(url)!r} has unknown scheme {scheme!r}; {hint}") from None
    except ValueError:
        raise ImproperlyConfigured(f"{name}={redact(url)!r} is malformed (check port and quoting); {hint}") from None
    if not config.get("NAME"):
        raise ImproperlyConfigured(f"{name}={redact(url)!r} names no database; {hint}")
    if pool_size and config["ENGINE"] == "django.db.backends.postgresql":
        # a waiting thread gets the next connection given back; after 30 s it fails (the pool's own default)
        config["CONN_MAX_AGE"] = 0  # closing a pooled connection gives it back (Django refuses persistent ones)
        config.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": pool_size, "max_idle": 60.0}
    return config


def redis_url(name: str = "REDIS_URL") -> str:
    """A redis:// (or rediss://, unix://) URL, or "" when unset (the launcher then starts an embedded Redis)."""
    url = env_str(name)
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={redact(url)!r} is malformed (check the port)") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ImproperlyConfigured(f"{name}={redact(url)!r} must start with redis://, rediss:// or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ImproperlyConfigured(f"{name}={redact(url)!r} names no host; e.g. redis://127.0.0.1:6379/0")
    return url


def secret_key(debug: bool, path: Path, name: str = "DJANGO_SECRET_KEY") -> str:
    """The secret key: required from the environment in production; in development generated once into `path`."""
    value = env_str(name)
    if value:
        return value
    if not debug:
        raise ImproperlyConfigured(f"{name} must be set when DJANGO_DEBUG=0 (e.g. a 50-character random string)")
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    write_once(path, (secrets.token_urlsafe(50) + "\n").encode())  # processes starting at once agree on one key
    return path.read_text().strip()
