"""End to end on a real (namespaced) LAN: the site served on the bridge address, one agent per board, each board
its own host with its own address, its own monotonic clock days apart from the others' and a 20 Mbit link
shaped by tc; faults come from the world (a pulled cable, a frozen or throttled board, a stranger on the LAN)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import psutil
import pytest

from workers.device import free_port
from workers.testbed import Testbed, available
from workers.testbed.lab import Lab

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(available() is not None, reason=f"no namespaced testbed here: {available()}"),
]

# Three boards of three kinds: clock offsets of 0, 1 and 2 days (and some); wired links but the Nano's, on
# 20 Mbit (a board on slow Wi-Fi), which its agent measures and the planner takes into account.
DEVICES = [("nx-0", "jetson-xavier-nx", "b0"), ("tx2-0", "jetson-tx2", "b1"), ("nano-0", "jetson-nano", "b2")]
PORTS = "40000 40999"  # the boards' ephemeral port range: where gloo listens
JOB = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 32, "iterations": 8}


@pytest.fixture(scope="module")
def lab(tmp_path_factory, profile_cache):
    # one board more than devices: b3 is a stranger's machine on the same LAN
    tb = Testbed(name="aslan", boards=len(DEVICES) + 1, subnet="198.18.43.0/24", rate=None, rates={"b2": "20mbit"})
    tb.up()
    for board in tb.boards:  # as docs/deployment.md has a lab narrow the boards' data-plane ports for a firewall
        subprocess.run(["ip", "netns", "exec", board.netns, "sysctl", "-qw", f"net.ipv4.ip_local_port_range={PORTS}"],
                       check=True)  # fmt: skip
    try:
        var, port = tmp_path_factory.mktemp("lab"), free_port()
        with Lab(tb, var, port, DEVICES, ASTEROID_CACHE_DIR=profile_cache, ASTEROID_STORE_PORT=free_port()) as lab:
            yield lab
    finally:
        tb.down()


def run_job(lab, job: dict | None = None, during=None) -> tuple[dict, list[str]]:
    """Plan and launch a job on the lab's boards; `during(job_id)` runs once iteration 2 is done."""
    return lab.run_job({**JOB, **(job or {})}, during)


def test_a_job_across_boards_with_clocks_days_apart_completes_with_a_whole_timeline(lab):
    final, lines = run_job(lab)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines) + "\n" + lab.tail()
    assert [g["reason"] for g in final["generations"]] == ["start"], lines  # no spurious recovery
    devices = set(final["devices"])
    assert len(devices) >= 2, final["plan"]
    steps = lab.events(final["id"], "step")
    # every board's steps arrived, none dropped for a negative time
    assert {s["device"] for s in steps} == devices
    assert all(0 <= s["start"] <= s["end"] for s in steps), [s for s in steps if not 0 <= s["start"] <= s["end"]]
    for it in range(JOB["iterations"]):
        assert {s["device"] for s in steps if s["iteration"] == it and s["kind"] == "F"} == devices, it
    # a receive never ends before its data arrived, across boards whose clocks are days apart (a recv is the wait
    # for a micro-batch's activations or gradients: it ends once the first of the sends to it for them arrived)
    recvs = [s for s in steps if s["kind"] == "recv"]
    assert recvs
    for r in recvs:
        arrivals = [s["end"] for s in steps if s["kind"] == "send" and s["peer"] == r["device"]
                    and (s["iteration"], s["micro_batch"]) == (r["iteration"], r["micro_batch"])]  # fmt: skip
        assert arrivals, r
        assert r["end"] >= min(arrivals) - 0.01, (r, arrivals)
    # the Nano's agent measured its 20 Mbit link, and the plan kept the Nano off the pipeline's links
    links = {d["name"]: d["measured"].get("link_mbps") for d in lab.api("/api/devices/")["devices"]}
    assert 10 < links["nano-0"] < 25 and links["nx-0"] > 125 and links["tx2-0"] > 125, links
    own = {d["name"]: d.get("bandwidth_mbps") for d in final["plan"]["cluster"]["devices"]}
    assert own == {"nx-0": None, "tx2-0": None, "nano-0": links["nano-0"]}, own
    assert "nano-0" not in devices, final["plan"]["stages"]
    # every device's row ends done; nothing happens to the job once it completed
    time.sleep(6)
    again = lab.api(f"/api/jobs/{final['id']}/")
    assert again["status"] == "completed" and again["generations"] == final["generations"]
    assert lab.log_lines(final["id"]) == lines
    states = lab.shell(
        "import json\nfrom webapp.jobs.models import JobDevice\n"
        f"rows = JobDevice.objects.filter(job_id={final['id']})\n"
        "print(json.dumps(sorted(set(rows.values_list('state', flat=True)))))"
    )
    assert "lost" not in states, states
    for name in devices:  # the agents name the device and its generation, not "rank 0"
        assert f"device {name}" in lab.agent_log(name), lab.agent_log(name)[-2000:]


def board_in_plan(lab, job_id: int, last: bool = False) -> tuple[str, str]:
    """A device the job's plan uses, other than its first stage's first device, and its board."""
    job = lab.api(f"/api/jobs/{job_id}/")
    names = [d["name"] for st in job["plan"]["stages"] for d in st["devices"]]
    name = names[-1] if last else names[min(1, len(names) - 1)]
    return name, lab.board_of[name]


def run_faulted_job(lab, job: dict, fault, mend) -> tuple[dict, list[str], str | None]:
    """`run_job` with `fault(job_id)` once iteration 2 is done: it does something to a board of the job and returns
    that (device, board); `mend(board)` undoes it when the job ended, however it ended. The ended job, its log
    lines and the device."""
    faulted = []
    try:
        final, lines = run_job(lab, job, during=lambda job_id: faulted.append(fault(job_id)))
    finally:
        for _device, board in faulted:
            mend(board)
    return final, lines, faulted[0][0] if faulted else None


def test_a_pulled_cable_is_recovered_and_the_board_comes_back_fenced(lab):
    def unplug(job_id):
        device, board = board_in_plan(lab, job_id)
        lab.tb.unplug(board)
        return device, board

    final, lines, device = run_faulted_job(lab, {"iterations": 10}, unplug, lab.tb.plug)
    plugged = datetime.now(UTC)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines)
    assert final["message"].startswith("10 iterations"), final["message"]
    assert [g["reason"] for g in final["generations"]] == ["start", "lost"], lines
    lost = [line for line in lines if line.startswith(f"device {device} lost at iteration")]
    assert lost and "no heartbeat" in lost[0], lines

    # plugged back, its agent is heard again (on its old socket or a new one) and the device is free for the next
    # job: its stale generation did nothing. (Online alone may still be the site's view of the dead socket.)
    def heard():
        row = {d["name"]: d for d in lab.api("/api/devices/")["devices"]}[device]
        return row["status"] == "online" and datetime.fromisoformat(row["last_heartbeat"]) > plugged

    lab.wait(f"{device} back online", heard, 90)
    assert lab.api(f"/api/jobs/{final['id']}/")["status"] == "completed"


def test_a_link_flap_shorter_than_the_detection_window_evicts_no_one(lab):
    def flap(job_id):
        _, board = board_in_plan(lab, job_id)
        lab.tb.flap(board, 1.5)

    final, lines = run_job(lab, {"iterations": 10}, during=flap)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines)
    assert [g["reason"] for g in final["generations"]] == ["start"], lines


def test_a_frozen_board_is_detected_and_fenced_when_it_thaws(lab):
    def freeze(job_id):
        device, board = board_in_plan(lab, job_id, last=True)
        lab.tb.freeze(board)

        def thaw_later():  # a hung board that comes back after it was replaced: its old generation is over
            time.sleep(20)
            lab.tb.thaw(board)

        threading.Thread(target=thaw_later, daemon=True).start()
        return device, board

    final, lines, device = run_faulted_job(lab, {"iterations": 10}, freeze, lab.tb.thaw)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines)
    assert [g["reason"] for g in final["generations"]] == ["start", "lost"], lines
    lost = [line for line in lines if line.startswith(f"device {device} lost at iteration")]
    assert lost and "no heartbeat" in lost[0], lines


def test_a_throttled_board_is_measured_and_the_job_re_partitions(lab):
    def throttle(job_id):
        # The fastest kind: an emulated board computes for real only a part of its dilated step time (the
        # dilation leaves every device headroom, the fastest kind least, about a third): 10 % of a core is too
        # little for it, as for a real board held to a tenth of its speed.
        assert "nx-0" in lab.api(f"/api/jobs/{job_id}/")["devices"]
        lab.tb.throttle(lab.board_of["nx-0"], 10)
        return "nx-0", lab.board_of["nx-0"]

    final, lines, device = run_faulted_job(lab, {"iterations": 14}, throttle, lab.tb.unthrottle)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines)
    assert "repartition" in [g["reason"] for g in final["generations"]], "\n".join(lines)
    said = [line for line in lines if line.startswith("re-partitioned after iteration")]
    assert said and f"{device} computes" in said[0], lines


STRANGER = """
import sys
from datetime import timedelta
import torch.distributed as dist
try:
    store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, timeout=timedelta(seconds=5))
    print("read:", store.get(sys.argv[3]))
except Exception as e:
    print("refused:", type(e).__name__)
"""


def test_a_stranger_on_the_lan_cannot_reach_a_jobs_store(lab):
    seen = {}

    def intrude(job_id):
        env = lab.env
        # the only ports open to the LAN are the site's and the store gateway's: fixed, and a firewall can name them
        site = psutil.Process(lab.proc.pid)
        listening = {
            f"{c.laddr.ip}:{c.laddr.port}"
            for proc in [site, *site.children(recursive=True)]
            for c in proc.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        seen["exposed"] = {a for a in listening if not a.startswith(("127.", "::1:", "::ffff:127."))}
        # a board listens for the data plane only within its narrowed ephemeral range (what a firewall names)
        _, board = board_in_plan(lab, job_id)
        ns = lab.tb.board(board).netns
        on_board = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn"], capture_output=True, text=True).stdout
        seen["board"] = [line.split()[3] for line in on_board.splitlines() if line.split()
                         and line.split()[3].startswith(lab.tb.board(board).address + ":")]  # fmt: skip
        port = env["ASTEROID_STORE_PORT"]
        stranger = [sys.executable, "-c", STRANGER, lab.tb.site_address, port, "asteroid/gen0/config"]
        out = lab.tb.board("b3").run(stranger, capture_output=True, text=True, timeout=60)
        seen["stranger"] = out.stdout + out.stderr

    final, lines = run_job(lab, during=intrude)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines)
    site, gateway = f"{lab.tb.site_address}:{lab.env['ASTEROID_PORT']}", lab.env["ASTEROID_STORE_PORT"]
    assert seen["exposed"] == {site, f"{lab.tb.site_address}:{gateway}"}, seen["exposed"]
    low, high = map(int, PORTS.split())
    assert seen["board"] and all(low <= int(a.rsplit(":", 1)[1]) <= high for a in seen["board"]), seen["board"]
    assert "refused:" in seen["stranger"] and "read:" not in seen["stranger"], seen["stranger"]


LOGIN = """
import http.cookiejar, re, ssl, sys, urllib.parse, urllib.request
url, ca, password = sys.argv[1], sys.argv[2], sys.argv[3]
context = ssl.create_default_context(cafile=ca) if url.startswith("https:") else None
jar = http.cookiejar.CookieJar()
handlers = [urllib.request.HTTPCookieProcessor(jar), urllib.request.HTTPSHandler(context=context)]
opener = urllib.request.build_opener(*handlers)
page = opener.open(url + "/accounts/login/", timeout=30).read().decode()
token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
form = urllib.parse.urlencode({"username": "admin", "password": password, "csrfmiddlewaretoken": token}).encode()
request = urllib.request.Request(url + "/accounts/login/", data=form, headers={"Referer": url + "/accounts/login/"})
opener.open(request, timeout=30).read()
opener.open(url + "/jobs/", timeout=30).read()
print("session:" + next(c.value for c in jar if c.name == "sessionid"))
"""


class Capture:
    """Every frame that crosses a network interface (an AF_PACKET socket, as tcpdump reads them), kept in memory."""

    def __init__(self, interface: str):
        import socket

        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                self.frames.append(self.sock.recv(65535))
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        self.done.set()
        self.thread.join(5)
        self.sock.close()
        return b"".join(self.frames)


def test_a_listener_on_the_lan_reads_no_secret_during_a_whole_job(lab):
    """The lab's site is on a LAN address, so it serves TLS by default: a listener on the bridge during a board's
    enrollment, a person's login and a whole job reads no credential, token, cookie, job secret or store byte."""
    password = "lan-login-pass-123"
    lab.shell(f"from django.contrib.auth.models import User\nu = User.objects.get(username='admin')\n"
              f"u.set_password('{password}')\nu.save()\nprint(1)")  # fmt: skip
    capture = Capture(lab.tb.bridge)
    try:
        lab.enroll("nano-9", "jetson-nano", "b3")  # enrolled while listened to: token, credential, certificate
        lab.wait("nano-9 online", lab.online, 120)
        out = lab.tb.board("b3").run([sys.executable, "-c", LOGIN, lab.url, str(lab.ca), password],
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.stdout.startswith("session:"), out.stdout + out.stderr
        cookie = out.stdout.strip().split(":", 1)[1]
        final, lines = run_job(lab, {"devices": [name for name, _, _ in DEVICES]})
    finally:
        wire = capture.stop()
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines) + "\n" + lab.tail()
    assert len(wire) > 1_000_000, len(wire)  # the job's traffic crossed the bridge (activations included)
    import json

    said = {f"the credential of {name}": json.loads((lab.var / f"agent-{name}.json").read_text())["credential"]
            for name in [*(d[0] for d in DEVICES), "nano-9"]}  # fmt: skip
    said |= {"the API token": lab.token, "the session cookie": cookie}
    readable = [what for what, value in said.items() if value.encode() in wire]
    markers = (b"store_secret", b"ASTEROID-STORE", b"Bearer ", b"sessionid=", b"enrollment_token")
    readable += [m.decode() for m in markers if m in wire]
    assert readable == [], f"read on the LAN: {readable}"
