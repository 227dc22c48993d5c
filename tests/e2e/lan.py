"""A lab on the namespaced testbed: the site served on the bridge address as docs/deployment.md says, one
board per device running the real-board agent command (its own address, clock and shaped link)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import System, site_env, start_system, stop_system
from webapp.embedded_redis import free_port
from workers.testbed import Testbed

PY = sys.executable


class Lab:
    """The site on the testbed's bridge, and an agent on each board enrolled as one device."""

    def __init__(self, system: System, tb: Testbed, var: Path):
        self.system, self.tb, self.var = system, tb, var
        self.agents: dict[str, subprocess.Popen] = {}  # device name -> its agent process
        self.board_of: dict[str, str] = {}  # device name -> board

    def enroll(self, name: str, kind: str, board: str) -> None:
        """Register NAME on the site and start the agent command the site hands out, on BOARD."""
        made = self.system.api("/api/devices/", {"name": name, "kind": kind})
        command = made["command"].split()
        assert command[command.index("--server") + 1] == self.system.url, command  # the configured site, not a Host
        emulate = {"jetson-nano": "nano", "jetson-tx2": "tx2", "jetson-xavier-nx": "nx"}[kind]
        log = open(self.var / f"agent-{name}.log", "a")  # noqa: SIM115 (open while the agent runs)
        self.agents[name] = self.tb.board(board).popen(
            [PY, "-m", "workers.agent", "--server", self.system.url, "--token", made["enrollment_token"],
             "--emulate", emulate, "--state", str(self.var / f"agent-{name}.json")],
            cwd=Path(__file__).resolve().parents[2], env=self.system.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.board_of[name] = board

    def online(self) -> bool:
        return all(d["status"] in ("online", "busy") for d in self.system.api("/api/devices/")["devices"])

    def shell(self, code: str):
        """The JSON the site's Django shell prints for CODE (which prints one JSON document)."""
        return json.loads(self.system.manage("shell", "-c", code).strip().splitlines()[-1])

    def events(self, job_id: int, kind: str) -> list[dict]:
        code = (
            "import json\nfrom webapp.jobs.models import JobEvent\n"
            f"print(json.dumps([e.data for e in JobEvent.objects.filter(job_id={job_id}, type={kind!r})"
            ".order_by('pk')]))"
        )
        return self.shell(code)

    def agent_log(self, name: str) -> str:
        return (self.var / f"agent-{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.agents.values():
            proc.terminate()
        for proc in self.agents.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_lab(tb: Testbed, var: Path, profile_cache: Path, devices: list[tuple[str, str, str]], **settings) -> Lab:
    """The site on `tb`'s bridge address (no emulated agents of its own) and DEVICES (name, kind, board)."""
    env = site_env(var, free_port(), profile_cache, "none")
    env.update(ASTEROID_HOST=tb.site_address, **{k: str(v) for k, v in settings.items()})
    system = start_system(env, var / "system.log", host=tb.site_address)
    lab = Lab(system, tb, var)
    try:
        for name, kind, board in devices:
            lab.enroll(name, kind, board)
        system.wait("every board's agent online", lab.online, 120)
    except BaseException:
        lab.close()
        stop_system(system)
        raise
    return lab


def stop_lab(lab: Lab) -> None:
    lab.close()
    stop_system(lab.system)
