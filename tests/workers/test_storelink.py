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


# -- TLS, floods, strangers (issue 56) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki():
    """A site CA, the gateway's certificate for 127.0.0.1, and two boards' keys and certificates."""
    from engine import tls

    ca, ca_key = tls.make_ca("test")
    cert, key = tls.server_cert(ca, ca_key, ["127.0.0.1"])
    boards = []
    for device in (1, 2):
        board_key, csr = tls.make_csr()
        board_cert, serial = tls.sign_csr(ca, ca_key, csr, device)
        boards.append((board_cert, board_key, serial))
    return {"ca": ca, "server": tls.server_context(cert, key, client_ca=ca), "boards": boards}


@pytest.fixture
def tls_gateway(pki):
    g = Gateway("127.0.0.1", 0, pki["server"])
    g.start()
    yield g
    g.stop()


def board_tls(pki, i: int = 0):
    from engine import tls

    cert, key, _ = pki["boards"][i]
    return tls.client_context(pki["ca"], cert, key)


def test_over_tls_only_a_board_admitted_for_the_job_reaches_its_store(store, tls_gateway, pki):
    server, port = store
    secret = tls_gateway.open(7, port)
    tls_gateway.admit(7, pki["boards"][0][2])
    relay = Relay("127.0.0.1", tls_gateway.port, 7, secret, board_tls(pki, 0))
    local = relay.start()
    try:
        c = client(local)
        c.set("asteroid/gen0/config", "plan")
        assert server.get("asteroid/gen0/config") == b"plan"
    finally:
        relay.stop()
    # the other board knows the secret (a sniffed start message, say) but its certificate is not the job's
    with pytest.raises(StoreLinkError, match="refused job"):
        asyncio.run(connect("127.0.0.1", tls_gateway.port, 7, secret, board_tls(pki, 1)))
    # no certificate at all: the TLS handshake fails
    from engine import tls

    with pytest.raises(OSError):
        asyncio.run(connect("127.0.0.1", tls_gateway.port, 7, secret, tls.client_context(pki["ca"])))


def test_bytes_injected_on_the_path_end_the_connection_and_the_job_goes_on(store, tls_gateway, pki):
    """A host on the path (a forwarding proxy here) that slips bytes into a piped store connection: TLS sees a
    record that does not authenticate and closes; the next connection of the job is served as before."""
    server, port = store
    secret = tls_gateway.open(7, port)
    tls_gateway.admit(7, pki["boards"][0][2])

    async def scenario():
        injected = asyncio.Event()

        async def forward(src, dst, inject: bool):
            seen = 0
            while data := await src.read(65536):
                seen += len(data)
                dst.write(data)
                if inject and seen > 2048 and not injected.is_set():  # after the handshake, into the stream
                    dst.write(b"\x17\x03\x03\x00\x20" + b"X" * 32)  # a forged application-data record
                    injected.set()
                await dst.drain()
            dst.close()

        async def on_path(reader, writer):
            up_r, up_w = await asyncio.open_connection("127.0.0.1", tls_gateway.port)
            await asyncio.gather(forward(reader, up_w, True), forward(up_r, writer, False), return_exceptions=True)

        proxy = await asyncio.start_server(on_path, "127.0.0.1", 0)
        via = proxy.sockets[0].getsockname()[1]
        reader, writer = await connect("127.0.0.1", via, 7, secret, board_tls(pki, 0))
        writer.write(b"A" * 8192)  # store traffic that crosses the injection point
        await writer.drain()
        await asyncio.wait_for(injected.wait(), 5)
        with pytest.raises((ConnectionError, OSError, asyncio.IncompleteReadError)):
            while True:  # the gateway closes on the forged record: the stream ends (or errors) instead of answering
                if not await asyncio.wait_for(reader.read(65536), 5):
                    raise ConnectionError("closed")
        proxy.close()
        # the job goes on: a new connection (as torch's store client reconnects) is admitted
        again = await connect("127.0.0.1", tls_gateway.port, 7, secret, board_tls(pki, 0))
        again[1].close()

    asyncio.run(scenario())


def test_half_open_connections_of_a_stranger_do_not_starve_a_job(store, gateway):
    """500 connections that never answer, from another host: the gateway keeps PENDING_PER_HOST of them waiting,
    drops the rest at once, and a device's connection is admitted meanwhile."""
    server, port = store
    secret = gateway.open(7, port)
    flood = []
    try:
        for _ in range(500):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))  # another host on the loopback network
            s.connect(("127.0.0.1", gateway.port))
            flood.append(s)
        relay = Relay("127.0.0.1", gateway.port, 7, secret)
        local = relay.start()
        try:
            c = dist.TCPStore("127.0.0.1", local, None, False, timeout=timedelta(seconds=3))
            c.set("during-the-flood", "yes")
            assert server.get("during-the-flood") == b"yes"
        finally:
            relay.stop()
        dropped = 0
        for s in flood:  # those beyond the cap were closed at once (each waiting one would wait HANDSHAKE_S)
            s.settimeout(0.01)
            try:
                dropped += s.recv(1) == b""
            except ConnectionResetError:
                dropped += 1
            except TimeoutError:
                pass
        assert dropped >= 400  # (PENDING_PER_HOST is 32)
    finally:
        for s in flood:
            s.close()


def test_a_non_ascii_answer_is_refused_in_one_line(store, gateway, caplog):
    gateway.open(7, store[1])

    async def answer_with(line: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        await reader.readline()
        writer.write(line)
        await writer.drain()
        reply = await reader.readline()
        writer.close()
        return reply

    with caplog.at_level("WARNING", logger="workers.storelink"):
        assert asyncio.run(answer_with(b"7 " + "é".encode() * 32 + b"\n")) == b"DENIED\n"
        assert asyncio.run(answer_with(b"7 \xff\xfe\n")) == b"DENIED\n"
    lines = [r for r in caplog.records if r.name == "workers.storelink"]
    assert [r.exc_info for r in lines] == [None, None]  # one line each, no traceback
    assert all("not ASCII" in r.getMessage() for r in lines)


def test_the_relay_refuses_a_process_that_is_not_its_device_process(store, gateway):
    import subprocess
    import sys

    secret = gateway.open(7, store[1])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        relay = Relay("127.0.0.1", gateway.port, 7, secret, root=other.pid)  # serves that process's tree only
        local = relay.start()
        try:
            with pytest.raises(Exception):  # noqa: B017 - c10d's own error for a connection closed unanswered
                dist.TCPStore("127.0.0.1", local, None, False, timeout=timedelta(seconds=2)).get("x")
        finally:
            relay.stop()
    finally:
        other.kill()
        other.wait()
