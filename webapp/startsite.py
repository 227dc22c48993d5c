"""Start the whole site on one machine: `python -m webapp.startsite` (what `make run` does).

It serves on ASTEROID_HOST (default 127.0.0.1; a lab sets its LAN address, docs/deployment.md) at ASTEROID_PORT,
and the jobs' store gateway on ASTEROID_STORE_PORT of the same address.

It takes its var dir's lock (one launcher per ASTEROID_VAR_DIR: webapp/launchlock.py), starts an embedded Redis
unless REDIS_URL is set (else checks that one answers), applies migrations, makes sure an `admin` account exists,
then runs daphne (webapp.asgi), a Celery worker with beat (planning, health checks), the jobs' coordinators
(`manage.py coordinators`) and one emulated device
agent per device of cluster `ASTEROID_CLUSTER` (default C; `none` for no agents; a disabled device's too), until
Ctrl-C or SIGTERM, starting again whatever of it dies (the embedded Redis included), and stops everything it
started. The agents enroll like real boards: the launcher registers their devices
and hands each a one-time enrollment token; their credentials are kept in var/agents/. Settings are read
through webapp/env.py; a bad one, a busy port or var dir stops it with one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import os
import secrets
import signal
import socket
import ssl
import sys
import time
from dataclasses import replace
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from engine.errors import UserError
from webapp.children import CrashLoop, Supervised, stop
from webapp.embedded_redis import EmbeddedRedis, RedisStartError
from webapp.env import WILDCARDS, env_choice, env_str, redact, url_host
from webapp.launchlock import VarDirBusy, lock_var_dir
from workers.enroll import State, load_state, save_state

ADMIN = "admin"


class StartError(Exception):
    """A problem the user can fix (bad setting, busy port): printed as one line."""


class Stop(Exception):
    """Raised by the signal handler to unwind the supervision loop."""


def _on_signal(signum, frame):
    raise Stop(signal.Signals(signum).name)


def admin_password_from_env() -> str:
    """ASTEROID_ADMIN_PASSWORD exactly as given (spaces are part of a password), or "" when unset."""
    return env_str("ASTEROID_ADMIN_PASSWORD", strip=False)


def _bound(host: str, port: int, setting: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StartError(f"ASTEROID_HOST={host} cannot be resolved: {exc.strerror or exc}") from None
    family, _, _, _, address = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    # as daphne binds: a port whose last connections linger in TIME_WAIT after a stop is free to serve on
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(address)
    except OSError as exc:
        s.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StartError(
                f"ASTEROID_HOST={host} is not an address of this machine; use one that `ip addr` lists"
            ) from None
        raise StartError(f"port {port} on {host} is in use; stop what uses it or set {setting}") from None
    return s


def check_port_free(host: str, port: int, setting: str = "ASTEROID_PORT") -> None:
    _bound(host, port, setting).close()


def listen(host: str, port: int) -> socket.socket:
    """The site's listening socket, which every daphne process serves (`--fd`): the kernel hands each new
    connection to one of them, and while one is started again the others (or the backlog) take its share."""
    s = _bound(host, port, "ASTEROID_PORT")
    s.listen(1024)
    s.set_inheritable(True)
    return s


def _reach(host: str) -> str:
    """The address this machine reaches a server listening on `host` at (loopback for a wildcard)."""
    return "127.0.0.1" if host in WILDCARDS else host


def wait_for_site(host: str, port: int, daphnes: list[Supervised], timeout: float = 90.0, tls: bool = False) -> None:
    """Return once a daphne process answers an HTTP request on `port` (importing Django and torch with every other
    child starting beside it takes a while on a busy 2-core machine); fail if they all exit first."""
    deadline = time.monotonic() + timeout
    while any(d.proc.poll() is None for d in daphnes):
        if tls:  # its own certificate, on this machine: whether it answers is all that is asked here
            conn = http.client.HTTPSConnection(_reach(host), port, timeout=1, context=ssl._create_unverified_context())
        else:
            conn = http.client.HTTPConnection(_reach(host), port, timeout=1)
        try:
            conn.request("HEAD", "/accounts/login/")
            conn.getresponse()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise StartError(f"daphne did not answer on port {port} within {timeout:.0f} s") from None
            time.sleep(0.1)  # poll interval while daphne imports Django
        finally:
            conn.close()
    codes = ", ".join(str(d.proc.returncode) for d in daphnes)
    raise StartError(f"daphne exited with code {codes} before serving; see its output above")


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()


def check_redis(url: str, timeout: float = 3.0) -> None:
    """Fail with one line unless the Redis at `url` (REDIS_URL) answers a PING within `timeout` seconds: without
    it no child could work, and each would fill the log with connection errors."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        with client:
            client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        why = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
        raise StartError(
            f"REDIS_URL={redact(url)} does not answer: {why}; start that Redis, or unset REDIS_URL to use an "
            "embedded one"
        ) from None


def migrate() -> None:
    from django.core.management import call_command
    from django.db.utils import OperationalError

    try:
        call_command("migrate", interactive=False, verbosity=1)
    except OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StartError(f"cannot use the database: {first}") from None


def ensure_admin() -> str | None:
    """Create the `admin` superuser if missing; returns the password when it was just set, else None."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(username=ADMIN).exists():
        return None
    password = admin_password_from_env() or secrets.token_urlsafe(12)
    users.objects.create_superuser(ADMIN, email="", password=password)
    return password


def cluster_from_env():
    """The built-in cluster whose devices are emulated (`ASTEROID_CLUSTER`, default C), or None for `none`."""
    from engine.devices import CLUSTERS

    letter = env_choice("ASTEROID_CLUSTER", "C", list(CLUSTERS), "a built-in cluster")
    return CLUSTERS[letter] if letter else None


def agent_commands(cluster, server: str, state_dir: Path, pin: str = "") -> dict[str, list[str]]:
    """The command line of an emulated agent per device of `cluster`, registering devices that are new.
    A device whose saved credential no longer works (new database, revoked) gets a fresh enrollment token.
    A disabled device's agent runs too, as a real board's would: it stays connected and visible, takes no jobs,
    and is online as soon as staff enable it (webapp/agents/consumers.py)."""
    from engine.devices import SHORT
    from webapp.devices.models import Device

    state_dir.mkdir(parents=True, exist_ok=True)
    commands = {}
    for d in cluster.devices:
        device, _ = Device.objects.get_or_create(name=d.name, defaults={"kind": d.kind})
        if device.status == Device.Status.DISABLED:
            print(f"  {d.name} is disabled: its agent runs, and it takes no jobs until staff enable it")
        state = state_dir / f"{d.name}.json"
        args = [sys.executable, "-m", "workers.agent", "--server", server, "--emulate", SHORT[d.kind]]
        args += ["--state", str(state)] + (["--ca", pin] if pin else [])
        saved = _saved_state(state)
        if saved is None or Device.for_credential(saved.credential) != device:
            state.unlink(missing_ok=True)
            args += ["--token", device.issue_enrollment()]
        elif saved.server != server:  # the credential is this site's, wherever it is served now
            save_state(state, replace(saved, server=server))
        commands[d.name] = args
    return commands


def _saved_state(path: Path) -> State | None:
    try:
        return load_state(path)
    except UserError:  # unreadable or not a state file: enrolled afresh
        return None


def serve(
    listener: socket.socket,
    redis_url: str,
    redis_note: str,
    admin_password: str | None,
    cluster=None,
    redis: EmbeddedRedis | None = None,
) -> int:
    """Run daphne on `listener`, Celery workers (one with beat), the coordinators and the emulated agents until a
    signal (ASTEROID_DAPHNES, ASTEROID_CELERY_WORKERS, ASTEROID_COORDINATORS of each; default one). A child
    that crashes is started again (its running jobs go on: a coordinator resumes each from its central replica);
    one that keeps crashing stops the site, or, an agent, leaves its device offline. So is the launcher's own
    embedded Redis (`redis`), on its port: the children reconnect to it."""
    from django.conf import settings

    host, port = settings.ASTEROID_HOST, settings.ASTEROID_PORT
    env = {**os.environ, "REDIS_URL": redis_url}
    python = sys.executable
    procs: dict[str, Supervised] = {}
    agents: dict[str, Supervised] = {}
    try:
        # -W: Celery warns at length when run as root (containers, lab boards); it only matters with pickle,
        # and this app accepts JSON only. (A category filter cannot name celery's class before it is imported.)
        quiet_root = "ignore:You're running the worker with superuser privileges"
        worker = ["-W", quiet_root, "-m", "celery", "-A", "webapp", "--quiet"]
        for i in range(settings.ASTEROID_CELERY_WORKERS):
            name = "celery worker" if i == 0 else f"celery worker {i + 1}"
            # no gossip or mingle: nothing here uses them, and gossip fails with a traceback when Redis restarts
            command = [python, *worker, "worker", "-n", f"worker{i + 1}@%h", "--loglevel=WARNING", "--concurrency=2",
                       "--without-gossip", "--without-mingle"]  # fmt: skip
            procs[name] = Supervised(name, command + (["--beat"] if i == 0 else []), env=env)  # one beat
        # every running job's coordinator: the run's store, its recoveries (webapp/jobs/coordinating.py)
        # (several share the jobs through leases, each with its own store gateway: webapp/jobs/leases.py)
        for i in range(settings.ASTEROID_COORDINATORS):
            name = "coordinators" if i == 0 else f"coordinators {i + 1}"
            store_port = str(settings.ASTEROID_STORE_PORT + i)
            command = [python, str(settings.BASE_DIR / "manage.py"), "coordinators", "--store-port", store_port]
            procs[name] = Supervised(name, command, env=env)
        daphne = [python, "-m", "daphne", "--fd", str(listener.fileno()), "webapp.asgi:application"]
        pin = ""
        if settings.ASTEROID_TLS:  # HTTPS and wss on the same socket (webapp/tlsdaphne.py)
            from webapp import sitetls

            cert, key = sitetls.ensure().https
            daphne = [python, "-m", "webapp.tlsdaphne", "--fd", str(listener.fileno()), str(cert), str(key),
                      "webapp.asgi:application"]  # fmt: skip
            pin = sitetls.pin()
        daphnes = []
        for i in range(settings.ASTEROID_DAPHNES):
            name = "daphne" if i == 0 else f"daphne {i + 1}"
            procs[name] = Supervised(name, daphne, env=env, pass_fds=(listener.fileno(),))
            daphnes.append(procs[name])
        wait_for_site(host, port, daphnes, tls=settings.ASTEROID_TLS)
        if cluster is not None:
            scheme = "https" if settings.ASTEROID_TLS else "http"
            local = f"{scheme}://{url_host(_reach(host))}:{port}"  # the emulated agents run on this machine
            commands = agent_commands(cluster, local, settings.VAR_DIR / "agents", pin)
            agents = {name: Supervised(f"the agent of {name}", args, env=env) for name, args in commands.items()}
        print(f"\nAsteroid is running at {settings.ASTEROID_SITE_URL}/", flush=True)
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(
                f"  boards enroll with: make agent SERVER={settings.ASTEROID_SITE_URL} TOKEN=T"
                + (f" CA={pin}" if pin else "")
            )
            if pin:
                bundle = settings.VAR_DIR / "tls" / "bundle.pem"
                print(f"  TLS: the site's CA is {bundle} (boards pin it; import it in the lab's browsers)")
            else:
                print(
                    "  warning: plain HTTP on a LAN address (ASTEROID_TLS=0): anyone on the LAN can read the boards' "
                    "credentials and jobs' secrets",
                    flush=True,
                )
            last = settings.ASTEROID_STORE_PORT + settings.ASTEROID_COORDINATORS - 1
            ports = str(last) if last == settings.ASTEROID_STORE_PORT else f"{settings.ASTEROID_STORE_PORT}-{last}"
            print(f"  jobs' store gateway: {host}:{ports} (docs/deployment.md)")
        if admin_password:
            shown = "(from ASTEROID_ADMIN_PASSWORD)" if admin_password_from_env() else admin_password
            print(f"  log in as {ADMIN} / {shown}   (new account; this password is not shown again)")
        else:
            print(f"  log in as {ADMIN}: the account exists, its password is unchanged")
        print(f"  Redis: {redis_url} ({redis_note})")
        if agents:
            print(f"  Emulated devices of cluster {cluster.name}: {', '.join(agents)} (their agents log below)")
        print("  Press Ctrl-C to stop.\n", flush=True)
        while True:
            try:
                said = redis.revive() if redis is not None else None
            except CrashLoop as exc:
                raise StartError(f"{exc}: stopping (see {redis.workdir / 'redis.log'})") from None
            if said:
                print(f"warning: {said}", flush=True)
            for child in procs.values():
                try:
                    said = child.revive()
                except CrashLoop as exc:
                    raise StartError(f"{exc}: stopping (its error is above)") from None
                if said:
                    print(f"warning: {said}", flush=True)
            for name, child in list(agents.items()):
                try:
                    said = child.revive()
                except CrashLoop as exc:  # a device going away is something the site shows, not a reason to stop
                    print(f"warning: {exc} (its error is above): {name} stays offline until the site is started "
                          "again", flush=True)  # fmt: skip
                    del agents[name]
                    continue
                if said:
                    print(f"warning: {said}", flush=True)
            time.sleep(0.5)  # supervision interval: how soon a crashed child is noticed
    except Stop as sig:
        print(f"\n{sig}: stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the coordinators first: a job's coordinator must not take its agents' stopping for lost devices (it
        # stops without ending the job, which resumes from its central replica when the site starts again)
        first = [procs.pop(name) for name in list(procs) if name.startswith("coordinators")]
        for child in [*first, *agents.values(), *reversed(procs.values())]:
            stop(child.proc)


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m webapp.startsite",
        description="Start the Asteroid site: Redis (embedded unless REDIS_URL), migrations, daphne, Celery, the "
        "jobs' coordinators and emulated device agents, until Ctrl-C. Every setting comes from the environment: "
        "ASTEROID_HOST (address to serve on, default 127.0.0.1), ASTEROID_PORT (8000), ASTEROID_STORE_PORT "
        "(ASTEROID_PORT + 1), ASTEROID_SITE_URL, ASTEROID_CLUSTER (C; none for no emulated agents), DATABASE_URL, "
        "REDIS_URL; see README 'Configuration' and docs/deployment.md.",
    )


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)  # --help, and a one-line error for anything else
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    redis = listener = lock = None
    try:
        setup_django()  # reads every setting: a bad one fails here, before anything starts
        from django.conf import settings

        lock = lock_var_dir(settings.VAR_DIR)  # before anything in it is touched: one launcher per var dir
        listener = listen(settings.ASTEROID_HOST, settings.ASTEROID_PORT)
        for i in range(settings.ASTEROID_COORDINATORS):  # a store gateway per coordinators process
            check_port_free(settings.ASTEROID_HOST, settings.ASTEROID_STORE_PORT + i, "ASTEROID_STORE_PORT")
        cluster = cluster_from_env()
        redis_url, redis_note = settings.REDIS_URL, "from REDIS_URL"
        if redis_url:
            check_redis(redis_url)
        else:
            redis = EmbeddedRedis(settings.VAR_DIR / "redis")
            redis_url, redis_note = redis.start(), "embedded, stops with this launcher"
        if settings.ASTEROID_TLS:  # the site CA and certificate, made on the first start (webapp/sitetls.py)
            from webapp import sitetls

            sitetls.ensure()
        migrate()
        password = ensure_admin()
        return serve(listener, redis_url, redis_note, password, cluster, redis)
    except (StartError, ImproperlyConfigured, RedisStartError, UserError, VarDirBusy) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stop:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if redis is not None:
            redis.stop()
        if listener is not None:
            listener.close()
        if lock is not None:
            os.close(lock)  # last: everything it started has stopped


if __name__ == "__main__":
    sys.exit(main())
