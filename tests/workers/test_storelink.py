"""The authenticated path to a job's store (workers/storelink.py): only a relay that knows the job's secret gets
through the gateway, and the store itself listens on loopback only (regression: anyone on the LAN could read a
job's plan and write its abort key)."""

import asyncio
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from workers.storelink import Gateway, Relay, StoreLinkError, connect


@pytest.fixture
def store():
    """A job's store as the coordinator runs it: on a loopback listening socket of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False,
                           master_listen_fd=listener.detach())  # fmt: skip
    yield server, port


@pytest.fixture
def gateway():
    g = Gateway("127.0.0.1", 0)
    g.start()
    yield g
    g.stop()


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5))


def test_a_relay_with_the_jobs_secret_reaches_its_store(store, gateway):
    server, port = store
    secret = gateway.open(7, port)
    assert gateway.open(7, port) == secret  # a resent start gets the same secret
    relay = Relay("127.0.0.1", gateway.port, 7, secret)
    local = relay.start()
    try:
        c = client(local)
        c.set("asteroid/gen0/config", "plan")
        assert server.get("asteroid/gen0/config") == b"plan"
        server.set("asteroid/end", "completed")
        assert c.get("asteroid/end") == b"completed"
        big = bytes(range(256)) * 8192  # 2 MiB: a central replica's piece
        c.set("big", big)
        assert server.get("big") == big
    finally:
        relay.stop()


@pytest.mark.parametrize("job, secret", [(7, "0" * 64), (8, None)])
def test_a_wrong_secret_or_another_job_is_refused(store, gateway, job, secret):
    _, port = store
    right = gateway.open(7, port)
    with pytest.raises(StoreLinkError, match="refused job"):
        asyncio.run(connect("127.0.0.1", gateway.port, job, secret or right))


def test_a_raw_store_client_gets_nothing_from_the_gateway(store, gateway):
    # torch's own client (an intruder on the LAN) cannot speak to the store through the gateway
    gateway.open(7, store[1])
    with pytest.raises(Exception):  # noqa: B017 - c10d raises its own errors for a peer that is not a store
        dist.TCPStore("127.0.0.1", gateway.port, None, False, timeout=timedelta(seconds=2)).get("asteroid/gen0/config")


def test_a_closed_job_admits_no_one(store, gateway):
    secret = gateway.open(7, store[1])
    gateway.close(7)
    with pytest.raises(StoreLinkError):
        asyncio.run(connect("127.0.0.1", gateway.port, 7, secret))


def test_the_coordinators_store_listens_on_loopback_only(tmp_path):
    from engine.runtime.coordinator import Coordinator
    from engine.runtime.options import RunOptions
    from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

    plan = make_plan("gpt-small", cluster_of("nx", "tx2"), 4, 1, [(0, 5, [("nx-0", 4)]), (5, 15, [("tx2-1", 4)])])
    coordinator = Coordinator(plan, model_workload("gpt-small"), RunOptions(iterations=1), run_dir=tmp_path,
                              replicate_every=0)  # fmt: skip
    coordinator._start_store()
    assert coordinator.store_address[0] == "127.0.0.1"
    sockets = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    port = f":{coordinator.store.port:04X}"
    listening = [fields[1] for fields in sockets if fields[3] == "0A" and fields[1].endswith(port)]
    assert listening and all(local.startswith("0100007F:") for local in listening)  # 127.0.0.1 only
