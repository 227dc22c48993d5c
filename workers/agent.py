"""The device agent: enrolls once, then keeps a session with the site and runs the device processes it asks for.

    make agent SERVER=http://HOST:8000 TOKEN=ENROLLMENT_TOKEN [EMULATE=nano|tx2|nx]  # the checkout's Python
    python -m workers.agent --server http://HOST:8000 --token ENROLLMENT_TOKEN [--emulate nano|tx2|nx]
    python -m workers.agent --server http://HOST:8000          # later runs: the credential is in the state file

In-process (tests, or a launcher starting emulated devices), with a credential from `workers.enroll.enroll`:

    state = enroll(Site.parse("http://127.0.0.1:8000"), token)
    agent = Agent("http://127.0.0.1:8000", state.credential, emulate="nano")
    thread = threading.Thread(target=agent.run)   # or `await agent.serve()` on a running loop
    thread.start()
    agent.connected.wait(30)                        # set once the site welcomed it; agent.device is its name
    ...
    agent.stop()                                    # thread-safe; ends any run, sends what is left, returns
    thread.join()

`run()` raises `Refused` (a UserError) when the site refuses the credential. `workload=` replaces the
host's model profiles (model name -> engine Workload), for quick runs of made-up workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.devices import get_kind
from engine.errors import ErrorFirstParser, UserError
from workers.enroll import default_state_path, obtain
from workers.health import Health
from workers.joblog import JobLog
from workers.site import Site

if TYPE_CHECKING:
    from engine.costmodel import Workload
    from workers.probe import Capacity

log = logging.getLogger("workers.agent")
PROTOCOL_VERSION = 1
LINK_EVERY_S = 600.0  # a (re)connecting agent measures its link again when the last measurement is this old


class Agent:
    """One device's agent: its outbox, its job runner and its connection to the site."""

    def __init__(
        self,
        site: Site | str,
        credential: str,
        emulate: str | None = None,
        workload: Callable[[str], Workload] | None = None,
        capacity: Capacity | None = None,
    ):
        from workers.connection import Connection
        from workers.device import Runner
        from workers.outbox import Outbox

        self.site = Site.parse(site) if isinstance(site, str) else site
        self.emulate = emulate
        self.capacity = capacity  # a probe.Capacity; None: measured when the agent starts
        self.credential = credential
        self.link: tuple[float | None, float] | None = None  # (Mbps or None, when measured) of its link to the site
        self.session = uuid.uuid4().hex  # events are numbered per agent process: a new one starts at seq 1
        self.outbox = Outbox()
        self.runner = Runner(self.site, credential, self.outbox, workload)
        self.connection = Connection(
            self.site, credential, self._hello, self.outbox, self.runner, health=Health().sample
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()

    @property
    def connected(self) -> threading.Event:
        """Set while a session with the site is up."""
        return self.connection.connected

    @property
    def device(self) -> str | None:
        """The site's name for this device, once welcomed."""
        return self.connection.device

    def run(self, signals: bool = False) -> None:
        """Serve until `stop()` (or SIGINT/SIGTERM with `signals`, main thread only) on a loop of its own."""
        asyncio.run(self.serve(signals))

    async def serve(self, signals: bool = False) -> None:
        """Serve on the running loop until `stop()`; its log lines about a job go to the job too."""
        joblog = JobLog(self.outbox)
        logging.getLogger("workers").addHandler(joblog)
        try:
            await self._serve(signals)
        finally:
            logging.getLogger("workers").removeHandler(joblog)

    async def _serve(self, signals: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self.stop)
        if self._stopping.is_set():
            return
        try:
            if self.capacity is None:
                from workers.probe import measure

                log.info("measuring this device...")
                self.capacity = await asyncio.to_thread(measure, self.emulate)
            c = self.capacity
            log.info(
                "%s%s: %.0f GFLOPS, %.1f GiB (host measured %.0f GFLOPS)",
                c.kind,
                " (emulated)" if c.emulated else "",
                c.gflops,
                c.memory_bytes / 2**30,
                c.host_gflops,
            )
            await self.connection.run(self._stop)
        finally:
            await asyncio.to_thread(self.runner.shutdown)  # nothing keeps training after the agent stops
            log.info("agent stopped")

    def stop(self) -> None:
        """Ask the agent to stop (from any thread); `run()` returns once any run is ended."""
        self._stopping.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _hello(self) -> dict:
        from workers.probe import local_address

        to = urlsplit(self.site.socket_url)  # other boards reach this one at its address on the route to the site
        port = to.port or (443 if to.scheme == "wss" else 80)
        address = await asyncio.to_thread(local_address, to.hostname, port)  # may ask the DNS
        self.runner.address = address  # the data plane binds there, not where the host name resolves (127.0.1.1)
        try:  # an agent on the site's own host (make run's emulated ones) has no LAN link to the site to measure
            on_site_host = ipaddress.ip_address(address).is_loopback
        except ValueError:
            on_site_host = False
        if not on_site_host and (self.link is None or time.monotonic() - self.link[1] > LINK_EVERY_S):
            from workers.linkprobe import measure_link

            mbps = await asyncio.to_thread(measure_link, self.site, self.credential)
            self.link = (mbps, time.monotonic())
            if mbps is not None:
                log.info("this board's link to the site: %.0f Mbps", mbps)
        from engine.data import datasets_here

        hello = {"type": "hello", "session": self.session, **self.capacity.to_dict(), "address": address}
        hello["datasets"] = await asyncio.to_thread(datasets_here)  # the site plans a job only where its data is
        if self.link is not None and self.link[0] is not None:
            hello["link_mbps"] = round(self.link[0], 1)
        return {**hello, "version": PROTOCOL_VERSION}


def build_parser() -> argparse.ArgumentParser:
    parser = ErrorFirstParser(
        prog="python -m workers.agent",
        description="Asteroid device agent: takes part in training runs the site assigns to this device.",
    )
    parser.add_argument("--server", required=True, help="the site's URL, e.g. http://HOST:8000")
    parser.add_argument("--token", help="enrollment token from the site (needed once; then the state file is used)")
    parser.add_argument("--emulate", metavar="KIND", help="present this host as a Jetson of KIND: nano, tx2 or nx")
    parser.add_argument("--state", help="state file (default ~/.config/asteroid/agent-<host>-<port>.json)")
    parser.add_argument(
        "--ca",
        metavar="PIN",
        default="",
        help="sha256:... pin of the site's CA, from the Add device line (https sites; needed to enroll)",
    )
    return parser


PACKAGES = ("websockets", "numpy", "torch", "cryptography")  # what an agent and its device processes import


def check_packages() -> None:
    """UserError naming the fix when this Python lacks what the agent needs (a board's system Python)."""
    import importlib.util

    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"this Python ({sys.executable}) has no {', '.join(missing)}: run the agent from the repository's "
            "directory with `make agent SERVER=... TOKEN=...` (it sets up the agent's own .venv-agent, keeping a "
            "system torch); "
            "the enrollment token is still unused"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("websockets").setLevel(logging.WARNING)  # its own connection chatter; ours is one line each
    try:
        site = Site.parse(args.server)
        if args.emulate:
            get_kind(args.emulate)
        check_packages()  # before the one-time token is spent
        path = Path(args.state).expanduser() if args.state else default_state_path(site)
        from engine.tls import check_pin

        state = obtain(site, args.token, path, check_pin(args.ca) if args.ca else "")
        if site.https and not state.certificate:
            log.warning(
                "this board has no certificate of the site's (enrolled before the site served TLS, or "
                "without --ca): jobs' store connections will be refused; enroll again with a new token"
            )
        agent = Agent(state.tls(site), state.credential, emulate=args.emulate)
        log.info("agent for device %s of %s (state %s)", state.device.get("name", "?"), site.url, path)
        agent.run(signals=True)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal handlers are in place
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
