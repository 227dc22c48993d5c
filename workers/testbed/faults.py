"""Faults from the world on a testbed's boards: pulled cables, frozen or throttled boards, slow or saturated links."""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from workers.testbed.net import PERIOD_US, Board, Network, TestbedError, cgroup, cgroup_pids, links, parse_rate, sh

# A bulk TCP sender, run on a board: as fast as its link takes for SECONDS, then it closes.
SENDER = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + seconds
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # little left queued when the time is up
s.settimeout(5)
s.connect((host, port))
s.settimeout(0.2)
chunk = bytes(65536)
while time.monotonic() < end:
    try:
        s.send(chunk)
    except TimeoutError:
        pass
s.close()
"""


class Testbed(Network):
    """The LAN of namespaced boards (see Network) and the faults it can inflict on them."""

    def unplug(self, board: str) -> None:
        """A pulled cable: the board's bridge port goes down, so the board's eth0 loses carrier. Silence, no RST."""
        sh("ip", "link", "set", self.board(board).port, "down")

    def plug(self, board: str) -> None:
        """The cable back in: the port up again (the board kept its address and routes, as a real one would)."""
        b = self.board(board)
        sh("ip", "link", "set", b.port, "up")
        sh("ip", "-n", b.netns, "route", "replace", "default", "via", self.site_address)

    def flap(self, board: str, seconds: float) -> None:
        """Unplug, wait SECONDS, plug back (blocking; run it in a thread to flap in the background)."""
        self.unplug(board)
        try:
            time.sleep(seconds)
        finally:
            self.plug(board)

    def freeze(self, board: str) -> None:
        """Every process on the board stops at once (cgroup freezer): a hung board that still holds its sockets."""
        self._freezer(board, "FROZEN")

    def thaw(self, board: str) -> None:
        """The frozen board's processes go on where they stopped."""
        self._freezer(board, "THAWED")

    def _freezer(self, board: str, state: str) -> None:
        path = cgroup("freezer", self.name, self.board(board).name) / "freezer.state"
        path.write_text(state + "\n")
        deadline = time.monotonic() + 5
        while read(path) != state and time.monotonic() < deadline:  # FREEZING until every task has stopped
            time.sleep(0.01)

    def throttle(self, board: str, percent: float) -> None:
        """A slow board: its processes together get PERCENT of one core (cgroup cpu.cfs_quota_us)."""
        if not 1 <= percent <= 100:
            raise TestbedError(f"bad throttle {percent}: give a percentage of one core from 1 to 100")
        path = cgroup("cpu", self.name, self.board(board).name)
        (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (path / "cpu.cfs_quota_us").write_text(f"{round(PERIOD_US * percent / 100)}\n")

    def unthrottle(self, board: str) -> None:
        (cgroup("cpu", self.name, self.board(board).name) / "cpu.cfs_quota_us").write_text("-1\n")

    def shape(self, board: str, rate: str | None) -> None:
        """Change the board's link rate live, both directions (None or 'none': unshaped)."""
        self.set_rate(self.board(board), parse_rate(rate))
        self.save()

    def status(self) -> dict:
        """Plain data: the site address and, per board, its address, rate, offset, link, freezer, quota and pids."""
        ports = links()
        boards = []
        for board in self.boards:
            flags = ports.get(board.port, {}).get("flags", [])
            quota = read(cgroup("cpu", self.name, board.name) / "cpu.cfs_quota_us")
            boards.append(
                asdict(board)
                | {
                    "link": "up" if "UP" in flags else "down",
                    "frozen": read(cgroup("freezer", self.name, board.name) / "freezer.state") != "THAWED",
                    "cpu_quota_percent": None if quota in (None, "-1") else round(100 * int(quota) / PERIOD_US),
                    "pids": cgroup_pids(cgroup("freezer", self.name, board.name)),
                }
            )
        return {"name": self.name, "subnet": str(self.subnet), "site_address": self.site_address, "boards": boards}

    def saturate(self, board: str, seconds: float) -> Saturation:
        """Fill the board's uplink for SECONDS: a bulk sender on the board into a sink on the site address."""
        return Saturation(self.board(board), self.site_address, seconds)


def read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


class Saturation:
    """A running saturate(): a sender process on the board and a sink thread here; stop() ends both."""

    def __init__(self, board: Board, site_address: str, seconds: float):
        self.received = 0
        self._stopping = threading.Event()
        self._server = socket.create_server((site_address, 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._sink = threading.Thread(target=self._drain, name=f"saturate-{board.name}", daemon=True)
        self._sink.start()
        cmd = [sys.executable, "-c", SENDER, site_address, str(self.port), str(seconds)]
        self.sender = board.popen(cmd)

    def _drain(self) -> None:
        """Accept the sender's one connection and count what it sends until it closes (or stop())."""
        conn = None
        while conn is None and not self._stopping.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
        if conn is None:
            return
        with conn:
            conn.settimeout(0.2)
            while not self._stopping.is_set():
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self.received += len(data)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the sender to finish its SECONDS; return the bytes the sink received."""
        self.sender.wait(timeout)
        self._sink.join(5)  # the bytes still queued on the link
        self.stop()
        return self.received

    def stop(self) -> None:
        if self.sender.poll() is None:
            self.sender.kill()
            self.sender.wait()
        self._stopping.set()
        self._sink.join()
        self._server.close()
