"""A lab on the testbed, as docs/deployment.md sets one up: the site served on the bridge address with no
emulated agents of its own, and on each board the agent command the site hands out."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from workers.testbed.faults import Testbed
from workers.testbed.net import TestbedError

ROOT = Path(__file__).resolve().parents[2]
READY = "Press Ctrl-C to stop."
EMULATE = {"jetson-nano": "nano", "jetson-tx2": "tx2", "jetson-xavier-nx": "nx"}


def site_api(url: str, token: str, path: str, body: dict | None = None, ca: Path | None = None) -> dict:
    """The site's JSON API at `url` with an API token: GET `path`, or POST `body` to it; an https site's
    certificate is checked against the CA bundle `ca` (the site's var/tls/bundle.pem)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET")
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Content-Type", "application/json")
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None and url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        return json.loads(response.read())


def end(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Lab:
    """The site (`python -m webapp.startsite`) on `tb`'s bridge and one enrolled agent per (name, kind, board).

    Files (the site's database, logs, the agents' credentials) live in `var`. `settings` are more environment
    variables for the site and the agents (ASTEROID_CACHE_DIR, ASTEROID_DETECT_S, ...)."""

    def __init__(self, tb: Testbed, var: Path, port: int, devices: list[tuple[str, str, str]], **settings):
        self.tb, self.var, self.devices = tb, Path(var), devices
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        self.env.update(
            ASTEROID_VAR_DIR=str(self.var), ASTEROID_HOST=tb.site_address, ASTEROID_PORT=str(port),
            ASTEROID_STORE_PORT=str(port + 1 if port < 65535 else 8001), ASTEROID_CLUSTER="none",
            ASTEROID_HEARTBEAT_S="2", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        self.env.update({k: str(v) for k, v in settings.items()})
        tls = self.env.get("ASTEROID_TLS", "1") not in ("0", "false", "no", "off")  # a LAN address: TLS by default
        self.url = f"{'https' if tls else 'http'}://{tb.site_address}:{port}"
        self.ca = self.var / "tls" / "bundle.pem"  # the site's CA, made on its first start
        self.log = self.var / "system.log"
        self.proc: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}  # device name -> its agent process
        self.board_of = {name: board for name, _kind, board in devices}
        self.token = ""

    # -- the site ---------------------------------------------------------------------------------------

    def start(self) -> Lab:
        """Serve the site, enroll every device and start its agent on its board; return once all are online."""
        self.var.mkdir(parents=True, exist_ok=True)
        starts = self.log.read_text().count(READY) if self.log.exists() else 0
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "webapp.startsite"], cwd=ROOT, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            self.wait("the site", lambda: self.log.read_text().count(READY) > starts, 120)
            self.token = self.manage("createtoken", "admin").strip().splitlines()[-1]
            for name, kind, board in self.devices:
                self.enroll(name, kind, board)
            self.wait("every board's agent online", self.online, 120)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def enroll(self, name: str, kind: str, board: str) -> None:
        """Register NAME on the site and run the agent command the site hands out on BOARD (its `make agent`
        line's python, directly: terminating make would leave its agent running)."""
        made = self.api("/api/devices/", {"name": name, "kind": kind})
        words = dict(w.split("=", 1) for w in made["command"].split() if "=" in w)  # make agent SERVER=... TOKEN=...
        server = words["SERVER"]  # the site's configured URL, not a browser's Host
        pin = ["--ca", words["CA"]] if "CA" in words else []  # over TLS: the pin of the site's CA
        log = open(self.var / f"agent-{name}.log", "a")  # noqa: SIM115 (open while the agent runs)
        self.agents[name] = self.tb.board(board).popen(
            [sys.executable, "-m", "workers.agent", "--server", server, "--token", made["enrollment_token"],
             "--emulate", EMULATE[kind], "--state", str(self.var / f"agent-{name}.json"), *pin],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def online(self) -> bool:
        return all(d["status"] in ("online", "busy") for d in self.api("/api/devices/")["devices"])

    def close(self) -> None:
        """Stop the agents, then the site."""
        for proc in [*self.agents.values(), *([self.proc] if self.proc else [])]:
            end(proc)

    # -- talking to it ----------------------------------------------------------------------------------

    def api(self, path: str, body: dict | None = None) -> dict:
        return site_api(self.url, self.token, path, body, self.ca)

    def launch(self, job_id: int, timeout: float = 30) -> dict:
        """Launch a planned job. While a device of its plan is not online, the site answers 409 and says to wait (a
        board faulted by the test before may be heard on its new socket just as the site sees its old one close):
        try again, as a user would, until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.api(f"/api/jobs/{job_id}/launch/", {})
            except urllib.error.HTTPError as exc:
                said = exc.read().decode(errors="replace")
                if exc.code != 409 or "or wait" not in said or time.monotonic() > deadline:
                    raise TestbedError(f"launching job {job_id}: {exc.code} {said}") from exc
            time.sleep(0.5)

    def manage(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        if out.returncode != 0:
            raise TestbedError(f"manage.py {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1:]}")
        return out.stdout

    def wait(self, what: str, check, timeout: float, every: float = 0.5):
        """Poll `check()` until it returns something truthy; TestbedError with the site's log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise TestbedError(f"the site exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            value = check()
            if value:
                return value
            time.sleep(every)  # polling a black box
        raise TestbedError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def shell(self, code: str):
        """The JSON document the site's Django shell prints last for CODE."""
        return json.loads(self.manage("shell", "-c", code).strip().splitlines()[-1])

    def events(self, job_id: int, kind: str) -> list[dict]:
        """The job's stored events of `kind`, in order."""
        code = (
            "import json\nfrom webapp.jobs.models import JobEvent\n"
            f"print(json.dumps([e.data for e in JobEvent.objects.filter(job_id={job_id}, type={kind!r})"
            ".order_by('pk')]))"
        )
        return self.shell(code)

    def log_lines(self, job_id: int) -> list[str]:
        return [e["message"] for e in self.events(job_id, "log")]

    def agent_log(self, name: str) -> str:
        return (self.var / f"agent-{name}.log").read_text(errors="replace")

    # -- jobs -------------------------------------------------------------------------------------------

    def planned(self, job: dict, timeout: float = 120) -> dict:
        """A new job (the API's fields), once planned."""
        new = self.api("/api/jobs/", job)
        done = self.wait("the plan", lambda: (j := self.api(f"/api/jobs/{new['id']}/"))["status"] not in
                         ("queued", "planning") and j, timeout)  # fmt: skip
        if done["status"] != "planned":
            raise TestbedError(f"job {new['id']} was not planned: {done['message']}")
        return done

    def reached(self, job_id: int, iteration: int, timeout: float = 240) -> dict:
        """The running job once it finished `iteration` (0-based); TestbedError if it ended before."""

        def check():
            job = self.api(f"/api/jobs/{job_id}/")
            if job["finished_at"]:
                raise TestbedError(f"job {job_id} ended ({job['status']}: {job['message']}) before iteration "
                                   f"{iteration + 1}:\n{self.tail()}")  # fmt: skip
            return job["status"] == "running" and (job["latest"].get("iteration") or 0) >= iteration and job

        return self.wait(f"iteration {iteration + 1}", check, timeout)

    def ended(self, job_id: int, timeout: float = 400) -> dict:
        return self.wait(f"job {job_id} to end", lambda: (j := self.api(f"/api/jobs/{job_id}/"))["finished_at"]
                         and j, timeout)  # fmt: skip

    def run_job(self, job: dict, during=None, after: int = 1) -> tuple[dict, list[str]]:
        """Plan and launch `job`; `during(job_id)` once iteration `after` (0-based) is done. The ended job and its
        log lines."""
        planned = self.planned(job)
        self.launch(planned["id"])
        if during is not None:
            self.reached(planned["id"], after)
            during(planned["id"])
        final = self.ended(planned["id"])
        return final, self.log_lines(planned["id"])
