"""The LAN: one network namespace per board on a bridge, tbf-shaped veth links, cgroups and clocks, and cleanup."""

from __future__ import annotations

import errno
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_DIR = Path("/run/asteroid-testbed")
CGROUPS = Path("/sys/fs/cgroup")
CONTROLLERS = ("freezer", "cpu")  # freezer first: its cgroup.procs is the list of a board's processes
NETNS_ETC = Path("/etc/netns")
NAME = re.compile(r"[a-z][a-z0-9]{0,7}")
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)")
FIRST_BOARD_HOST = 11  # boards are .11, .12, ... of the subnet; the bridge (the site) is .1
PERIOD_US = 100_000


class TestbedError(Exception):
    """A problem the user can fix (not root, a bad rate, an unknown board, ...): one line that names the fix."""

    __test__ = False  # not a pytest test class


def sh(*args: str, check: bool = True) -> str:
    """Run a command; return its stdout, or raise TestbedError with its first line of stderr."""
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        why = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[0]
        raise TestbedError(f"`{' '.join(args)}` failed: {why}")
    return proc.stdout


@functools.cache
def available() -> str | None:
    """None when a testbed can be built here (root, ip, tc, unshare, namespaces, cgroup v1), else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc and cgroups)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (install iproute2 / util-linux)"
    for controller in CONTROLLERS:
        if not (CGROUPS / controller / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} hierarchy at {CGROUPS / controller}"
    probe = subprocess.run(["unshare", "--net", "--time", "--", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network/time namespaces do not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TestbedError(f"bad testbed name {name!r}: use a lowercase letter then up to 7 letters or digits")


def parse_rate(rate: str | None) -> str | None:
    """A tc rate such as '20mbit' (or None for an unshaped link); raise TestbedError on anything else."""
    if rate is None or str(rate).strip().lower() in ("none", ""):
        return None
    text = str(rate).strip().lower()
    if not RATE.fullmatch(text) or float(RATE.fullmatch(text).group(1)) <= 0:
        raise TestbedError(
            f"bad rate {rate!r}: use a number with kbit, mbit or gbit (e.g. 500kbit, 20mbit, 1gbit), or none"
        )
    return text


def cgroup(controller: str, tb_name: str, board: str | None = None) -> Path:
    return CGROUPS / controller / tb_name / board if board else CGROUPS / controller / tb_name


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


@dataclass
class Board:
    """One board: its namespace, address, link rate, clock offset, and the way to start processes on it."""

    name: str
    netns: str
    address: str
    rate: str | None
    clock_offset_s: int
    interface: str = "eth0"  # the board's interface inside its namespace (for GLOO_SOCKET_IFNAME and the like)
    port: str = ""  # the host side of its veth, a port of the bridge
    testbed: str = field(default="", repr=False)

    def command(self, cmd: list[str]) -> list[str]:
        """CMD wrapped to run in this board's cgroups, network namespace and (for an offset) time namespace."""
        procs = [str(cgroup(c, self.testbed, self.name) / "cgroup.procs") for c in CONTROLLERS]
        enter = 'for f in "$1" "$2"; do echo $$ > "$f"; done; shift 2; exec "$@"'
        clock = []
        if self.clock_offset_s:
            off = str(self.clock_offset_s)
            clock = ["unshare", "--time", "--monotonic", off, "--boottime", off, "--"]
        return ["sh", "-c", enter, "sh", *procs, "ip", "netns", "exec", self.netns, *clock, *[str(c) for c in cmd]]

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen of CMD on this board (its pid is CMD's own: the wrapper execs all the way)."""
        return subprocess.Popen(self.command(cmd), **kwargs)

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run of CMD on this board."""
        return subprocess.run(self.command(cmd), **kwargs)


class Network:
    """A bridge in the root namespace (the site's address) and one namespaced board per veth port."""

    __test__ = False  # not a pytest test class (as Testbed)

    def __init__(
        self,
        name: str = "ast",
        boards: int = 4,
        subnet: str = "198.18.42.0/24",
        rate: str | None = "20mbit",
        rates: dict[str, str | None] | None = None,
        clock_offsets: dict[str, int] | None = None,
    ):
        check_name(name)
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as e:
            raise TestbedError(f"bad subnet {subnet!r} ({e}): use an IPv4 network such as 198.18.42.0/24") from None
        if boards < 1:
            raise TestbedError(f"bad board count {boards}: a testbed needs at least 1 board")
        fits = max(0, net.num_addresses - FIRST_BOARD_HOST - 1)
        if boards > fits:
            raise TestbedError(f"subnet {net} holds at most {fits} boards (from .{FIRST_BOARD_HOST}): use a /24")
        self.name, self.subnet, self.rate = name, net, parse_rate(rate)
        self.bridge, self.state_file = f"{name}-br", STATE_DIR / f"{name}.json"
        names = [f"b{i}" for i in range(boards)]
        rates, offsets = dict(rates or {}), dict(clock_offsets or {})
        for board in [*rates, *offsets]:
            if board not in names:
                raise TestbedError(f"unknown board {board!r}: this testbed has {names[0]}..{names[-1]}")
        self.boards: list[Board] = []
        for i, board in enumerate(names):
            offset = offsets.get(board, i * 86400 + i * 1234)
            if offset != int(offset) or offset < 0:
                raise TestbedError(f"bad clock offset {offset!r} for {board}: use whole seconds >= 0")
            address, rate = str(net.network_address + FIRST_BOARD_HOST + i), rates.get(board, self.rate)
            netns, port = f"{name}-{board}", f"{name}-{board}-h"
            self.boards.append(Board(board, netns, address, parse_rate(rate), int(offset), port=port, testbed=name))

    @property
    def site_address(self) -> str:
        """The bridge's address in the root namespace: where the site listens."""
        return str(self.subnet.network_address + 1)

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def board(self, name: str) -> Board:
        for board in self.boards:
            if board.name == name:
                return board
        raise TestbedError(f"unknown board {name!r}: this testbed has {', '.join(b.name for b in self.boards)}")

    @classmethod
    def load(cls, name: str = "ast"):
        """The testbed NAME that `up` built (from its state file)."""
        try:
            state = json.loads((STATE_DIR / f"{name}.json").read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed {name!r} is up: start one with `python -m workers.testbed up`") from None
        boards = state["boards"]
        return cls(
            name=name,
            boards=len(boards),
            subnet=state["subnet"],
            rate=state["rate"],
            rates={b["name"]: b["rate"] for b in boards},
            clock_offsets={b["name"]: b["clock_offset_s"] for b in boards},
        )

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"name": self.name, "subnet": str(self.subnet), "rate": self.rate}
        state["boards"] = [asdict(b) for b in self.boards]
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(self.state_file)

    def up(self) -> None:
        """Build the LAN, after removing whatever a testbed of this name left behind."""
        why = available()
        if why:
            raise TestbedError(f"cannot build a testbed here: {why}")
        remove(self.name)
        self._check_free()
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            no_ipv6(self.bridge)
            sh("ip", "addr", "add", f"{self.site_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for board in self.boards:
                self._add_board(board)
            self.save()
        except BaseException:
            remove(self.name)
            raise

    def _check_free(self) -> None:
        """Refuse names and a subnet that something else on this machine already uses."""
        ours = re.compile(rf"{self.name}-(br|b\d+-h)")
        for link in links():
            if ours.fullmatch(link):
                raise TestbedError(f"a link named {link} is not this testbed's: use another --name")
        for route in json.loads(sh("ip", "-j", "-4", "route", "show") or "[]"):
            dst = route.get("dst", "")
            if dst != "default" and ipaddress.IPv4Network(dst, strict=False).overlaps(self.subnet):
                raise TestbedError(f"subnet {self.subnet} overlaps {dst} on {route.get('dev')}: use another --subnet")

    def _add_board(self, board: Board) -> None:
        ns, peer, prefix = ["ip", "-n", board.netns], f"{self.name}-{board.name}-n", self.subnet.prefixlen
        sh("ip", "netns", "add", board.netns)
        sh(*f"ip link add {board.port} type veth peer name {peer} netns {board.netns}".split())
        sh(*ns, "link", "set", peer, "name", board.interface)
        no_ipv6(board.port)
        no_ipv6_inside = f"echo 1 > /proc/sys/net/ipv6/conf/{board.interface}/disable_ipv6"
        sh("ip", "netns", "exec", board.netns, "sh", "-c", no_ipv6_inside)
        sh("ip", "link", "set", board.port, "master", self.bridge, "up")
        sh(*ns, "link", "set", "lo", "up")
        sh(*ns, "addr", "add", f"{board.address}/{prefix}", "dev", board.interface)
        sh(*ns, "link", "set", board.interface, "up")
        sh(*ns, "route", "replace", "default", "via", self.site_address)
        etc = NETNS_ETC / board.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # lookups fail at once instead of stalling
        self.set_rate(board, board.rate)
        for controller in CONTROLLERS:
            cgroup(controller, self.name, board.name).mkdir(parents=True, exist_ok=True)

    def set_rate(self, board: Board, rate: str | None) -> None:
        """Shape both ends of the board's link with tbf (None: unshaped)."""
        for ns, dev in ((["-n", board.netns], board.interface), ([], board.port)):
            if rate is None:
                sh("tc", *ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                tbf = ["tbf", "rate", rate, "burst", "64kbit", "latency", "400ms"]
                sh("tc", *ns, "qdisc", "replace", "dev", dev, "root", *tbf)
        board.rate = rate

    def down(self) -> None:
        """Kill every process on the boards and remove every object of this testbed; safe to repeat."""
        remove(self.name)


def links() -> dict[str, dict]:
    """The root namespace's links by name, as `ip -j -d link show` describes them."""
    return {link["ifname"]: link for link in json.loads(sh("ip", "-j", "-d", "link", "show") or "[]")}


def no_ipv6(dev: str) -> None:
    """No IPv6 (router solicitations, DAD) on the testbed's root-side links: only its own IPv4 traffic."""
    path = Path("/proc/sys/net/ipv6/conf") / dev / "disable_ipv6"
    if path.exists():
        path.write_text("1\n")


def remove(name: str) -> None:
    """Remove everything of testbed NAME found on this machine (processes, cgroups, namespaces, links, state)."""
    check_name(name)
    if os.geteuid() != 0:
        raise TestbedError("removing a testbed needs root: run it with sudo")
    tops = [cgroup(c, name) for c in CONTROLLERS]
    for board in sorted({p.name for top in tops if top.is_dir() for p in top.iterdir() if p.is_dir()}):
        kill_cgroups(name, board)
        for controller in CONTROLLERS:
            if cgroup(controller, name, board).is_dir():
                rmdir_cgroup(cgroup(controller, name, board), name, board)
    for top in tops:
        if top.is_dir():
            top.rmdir()
    ours = re.compile(rf"{name}-b\d+")
    for ns in sh("ip", "netns", "list").split():
        if ours.fullmatch(ns):
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                kill(int(pid))  # started there by other means than Board.popen/run
            sh("ip", "netns", "del", ns, check=False)
    for etc in NETNS_ETC.glob(f"{name}-b*"):
        if ours.fullmatch(etc.name):
            shutil.rmtree(etc, ignore_errors=True)
    bridge, port = f"{name}-br", re.compile(rf"{name}-b\d+-h")
    for link, info in links().items():
        kind = info.get("linkinfo", {}).get("info_kind")
        if (link == bridge and kind == "bridge") or (port.fullmatch(link) and kind == "veth"):
            sh("ip", "link", "del", link, check=False)
    (STATE_DIR / f"{name}.json").unlink(missing_ok=True)


def rmdir_cgroup(path: Path, name: str, board: str, timeout: float = 10.0) -> None:
    """Remove a board's cgroup; EBUSY while a killed process is still leaving it (a loaded host) is waited out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        kill_cgroups(name, board)
        time.sleep(0.05)


def kill_cgroups(name: str, board: str) -> None:
    """SIGKILL every process of a board: frozen first so none can fork away, then thawed so the kills land."""
    state = cgroup("freezer", name, board) / "freezer.state"
    paths = [cgroup(c, name, board) for c in CONTROLLERS]
    if state.exists():
        state.write_text("FROZEN\n")
    for path in paths:
        for pid in cgroup_pids(path):
            kill(pid)
    if state.exists():
        state.write_text("THAWED\n")
    deadline = time.monotonic() + 5
    while any(cgroup_pids(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
