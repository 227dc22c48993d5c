"""The namespaced LAN testbed on a real kernel: reachability, clocks, shaping, cables, freezer, CPU quota, cleanup."""

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workers.testbed import Testbed, TestbedError, available

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(available() is not None, reason=f"no namespaced testbed here: {available()}"),
]

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def testbed():
    """make(name, **kwargs) builds a testbed that is always removed at the end, and the processes started on it."""
    made, procs = [], []

    def make(name, **kwargs):
        tb = Testbed(name=name, **kwargs)
        made.append(tb)
        tb.up()
        tb.procs = procs
        return tb

    yield make
    for tb in made:
        tb.down()
    for proc in procs:
        proc.kill()
        proc.wait()


def start(tb, board, code, **kwargs):
    """A python process running CODE on BOARD (stdout piped, text)."""
    proc = tb.board(board).popen([PY, "-u", "-c", code], stdout=subprocess.PIPE, text=True, **kwargs)
    tb.procs.append(proc)
    return proc


def run(tb, board, code, *args, timeout=15):
    """The stdout of CODE run on BOARD, stripped."""
    out = tb.board(board).run([PY, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def serve_once(address, reply=b"site"):
    """A listening socket on ADDRESS in the root namespace that answers one connection with REPLY."""
    server = socket.create_server((address, 0))

    def answer():
        with server:
            conn, _ = server.accept()
            with conn:
                conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    return server.getsockname()[1]


FETCH = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    print(s.recv(100).decode())
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except OSError as e:
    print(type(e).__name__)
"""


def test_boards_reach_each_other_and_the_site(testbed):
    tb = testbed("tbt1", boards=2, subnet="198.18.101.0/24")
    server = start(
        tb,
        "b0",
        "import socket\ns = socket.create_server(('0.0.0.0', 7001))\nprint('ready')\n"
        "c, _ = s.accept()\nc.sendall(b'from b0')\nc.close()",
    )
    assert server.stdout.readline().strip() == "ready"
    assert run(tb, "b1", FETCH, tb.board("b0").address, 7001) == "from b0"
    assert run(tb, "b1", FETCH, tb.site_address, serve_once(tb.site_address)) == "site"
    assert tb.site_address == "198.18.101.1" and [b.address for b in tb.boards] == ["198.18.101.11", "198.18.101.12"]


def test_clock_offset_inside_a_board(testbed):
    tb = testbed("tbt2", boards=2, subnet="198.18.102.0/24", clock_offsets={"b0": 0, "b1": 3 * 86400})
    for board, offset in (("b0", 0), ("b1", 3 * 86400)):
        before = time.monotonic()
        inside = float(run(tb, board, "import time; print(time.monotonic())"))
        assert before + offset - 2 < inside < time.monotonic() + offset + 2


PUSH = """
import socket, sys, time
t = time.monotonic()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.sendall(bytes(int(sys.argv[3])))
    s.shutdown(socket.SHUT_WR)
    assert s.recv(10) == b"ok"
print(time.monotonic() - t)
"""


def push_seconds(tb, board, nbytes):
    """Seconds for BOARD to push NBYTES to a sink on the site address until the sink has them all."""
    server = socket.create_server((tb.site_address, 0))

    def sink():
        with server:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass
                conn.sendall(b"ok")

    threading.Thread(target=sink, daemon=True).start()
    return float(run(tb, board, PUSH, tb.site_address, server.getsockname()[1], nbytes))


def test_shaping_slows_the_link(testbed):
    tb = testbed("tbt3", boards=1, subnet="198.18.103.0/24", rate="5mbit")
    slow = push_seconds(tb, "b0", 1_500_000)  # 12 Mbit at 5 Mbit/s: ~2.4 s
    tb.shape("b0", "1gbit")
    fast = push_seconds(tb, "b0", 1_500_000)
    tb.shape("b0", None)
    unshaped = push_seconds(tb, "b0", 1_500_000)
    assert slow > 1.5 and fast < slow / 4 and unshaped < slow / 4, (slow, fast, unshaped)
    assert Testbed.load("tbt3").board("b0").rate is None


def test_unplug_is_silence_and_plug_restores(testbed):
    tb = testbed("tbt4", boards=1, subnet="198.18.104.0/24")
    server = socket.create_server((tb.site_address, 0))
    server.listen(16)
    port = server.getsockname()[1]
    with server:
        assert run(tb, "b0", CONNECT, tb.site_address, port, 3) == "connected"
        tb.unplug("b0")
        assert tb.status()["boards"][0]["link"] == "down"
        assert run(tb, "b0", CONNECT, tb.site_address, port, 1.5) == "timeout"  # no RST, no refusal: silence
        tb.plug("b0")
        assert run(tb, "b0", CONNECT, tb.site_address, port, 3) == "connected"
        tb.flap("b0", seconds=1.0)
        assert run(tb, "b0", CONNECT, tb.site_address, port, 3) == "connected"
        assert tb.status()["boards"][0]["link"] == "up"


def test_freeze_stops_a_board_and_thaw_resumes_it(testbed):
    tb = testbed("tbt5", boards=1, subnet="198.18.105.0/24")
    counter = start(tb, "b0", "import time\ni = 0\nwhile True:\n    print(i)\n    i += 1\n    time.sleep(0.02)")
    seen = []
    threading.Thread(target=lambda: [seen.append(int(line)) for line in counter.stdout], daemon=True).start()
    time.sleep(0.5)
    assert seen, "the counter never printed"
    tb.freeze("b0")
    assert tb.status()["boards"][0]["frozen"] and counter.pid in tb.status()["boards"][0]["pids"]
    time.sleep(0.2)
    frozen_at = seen[-1]
    time.sleep(1.0)
    assert seen[-1] == frozen_at
    tb.thaw("b0")
    time.sleep(0.5)
    assert seen[-1] > frozen_at + 5


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def cpu_over(pid, wall):
    before = cpu_seconds(pid)
    time.sleep(wall)
    return cpu_seconds(pid) - before


def test_throttle_limits_cpu(testbed):
    tb = testbed("tbt6", boards=1, subnet="198.18.106.0/24")
    busy = start(tb, "b0", "while True: pass")
    time.sleep(0.2)
    free = cpu_over(busy.pid, 1.5)
    tb.throttle("b0", percent=20)
    assert tb.status()["boards"][0]["cpu_quota_percent"] == 20
    throttled = cpu_over(busy.pid, 1.5)
    tb.unthrottle("b0")
    assert throttled < 0.5 * free and throttled < 0.3 * 1.5 + 0.1, (free, throttled)
    assert cpu_over(busy.pid, 1.0) > 0.5, "unthrottle did not lift the quota"
    with pytest.raises(TestbedError, match="percentage"):
        tb.throttle("b0", percent=0)


def leftovers(name):
    """Whatever of testbed NAME is still on this machine."""
    found = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()]
    found = [ns for ns in found if ns.startswith(f"{name}-")]
    found += [
        line
        for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        if f" {name}-" in line
    ]
    found += [str(p) for p in (Path("/sys/fs/cgroup/cpu") / name, Path("/sys/fs/cgroup/freezer") / name) if p.exists()]
    found += [str(p) for p in Path("/etc/netns").glob(f"{name}-*")]
    found += [str(p) for p in [Path(f"/run/asteroid-testbed/{name}.json")] if p.exists()]
    return found


def test_down_removes_everything_and_up_recovers_from_a_crash(testbed):
    tb = testbed("tbt7", boards=2, subnet="198.18.107.0/24")
    orphan = start(tb, "b1", "import time; time.sleep(1000)")
    assert leftovers("tbt7")
    # A crash: the process that built it is gone, its objects and process remain; a new one of another size comes up.
    again = testbed("tbt7", boards=3, subnet="198.18.107.0/24")
    assert orphan.wait(timeout=5) == -9
    assert [b.name for b in Testbed.load("tbt7").boards] == ["b0", "b1", "b2"]
    start(again, "b2", "import time; time.sleep(1000)")
    again.state_file.unlink()  # down finds everything without the state file too
    again.down()
    assert leftovers("tbt7") == []
    again.down()
    tb.down()
    assert leftovers("tbt7") == []


def cli(*args):
    return subprocess.run([PY, "-m", "workers.testbed", *args], capture_output=True, text=True, cwd=REPO, timeout=30)


def test_cli_round_trip_and_one_line_errors():
    try:
        up = cli(
            "up",
            "--name",
            "tbt8",
            "--boards",
            "2",
            "--subnet",
            "198.18.108.0/24",
            "--rate-of",
            "b1=5mbit",
            "--offset",
            "b1=86400",
        )
        assert up.returncode == 0, up.stderr
        assert "198.18.108.12" in up.stdout and "198.18.108.1 " in up.stdout
        status = json.loads(cli("status", "--name", "tbt8", "--json").stdout)
        assert [(b["name"], b["rate"], b["clock_offset_s"]) for b in status["boards"]] == [
            ("b0", "20mbit", 0),
            ("b1", "5mbit", 86400),
        ]
        assert cli("run", "--name", "tbt8", "b1", "--", "sh", "-c", "exit 7").returncode == 7
        for args, words in [
            (("shape", "--name", "tbt8", "b0", "5xbit"), "bad rate"),
            (("freeze", "--name", "tbt8", "b9"), "unknown board"),
            (("up", "--name", "tbt9", "--rate", "fast"), "bad rate"),
            (("flap", "--name", "tbt8", "b0"), "seconds"),
            (("up", "--name", "tbt9", "--subnet", "198.18.108.0/24"), "overlaps"),  # tbt8's subnet
            (("up", "--name", "tbt9", "--boards", "5", "--subnet", "198.18.109.0/28"), "at most 4 boards"),
        ]:
            out = cli(*args)
            assert out.returncode == 2 and out.stdout == "", out
            assert out.stderr.startswith("error: ") and words in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert cli("down", "--name", "tbt8").returncode == 0
        assert leftovers("tbt8") == [] and leftovers("tbt9") == []
        assert cli("status", "--name", "tbt8").returncode == 2
        # A link that has a testbed's name but is not a testbed's: left alone, and `up` says so.
        subprocess.run(["ip", "link", "add", "tbt9-br", "type", "veth", "peer", "name", "tbt9-x"], check=True)
        out = cli("up", "--name", "tbt9", "--subnet", "198.18.109.0/24")
        assert out.returncode == 2 and "tbt9-br is not this testbed's" in out.stderr, out
    finally:
        cli("down", "--name", "tbt8")
        cli("down", "--name", "tbt9")
        subprocess.run(["ip", "link", "del", "tbt9-br"], capture_output=True)
