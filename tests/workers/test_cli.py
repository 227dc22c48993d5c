"""`python -m workers.agent`: one-line errors with exit 2, a clean stop on SIGTERM, a refused credential."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.devices import KINDS
from tests.workers.fakesite import FakeSite
from tests.workers.httpfakes import not_http
from workers.enroll import State, save_state, token_digest

ROOT = Path(__file__).resolve().parents[2]


def agent(tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "HOME": str(tmp_path)}  # the default state file goes under this test's directory
    return subprocess.Popen(
        [sys.executable, "-m", "workers.agent", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, list[str]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # never leave an agent behind a failed test
        proc.communicate()
        raise
    return proc.returncode, err.splitlines()


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --server"),
        (["--server", "localhost:8000"], "--server must be an http(s) URL like http://HOST:8000"),
        (["--server", "http://h:8000", "--emulate", "orin"], "unknown device kind 'orin'; known kinds:"),
        (["--server", "http://h:8000"], "no credential for http://h:8000 (no state file "),
        (["--server", "http://127.0.0.1:1", "--token", "t"], "cannot reach the server at http://127.0.0.1:1"),
        (["--server", "http://\u00f1\U0001f600:8000", "--token", "t"], "is not a valid server URL"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, message):
    code, err = finish(agent(tmp_path, *argv))
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_server_that_does_not_speak_http_is_one_line_at_once(tmp_path):
    with not_http() as port:
        started = time.monotonic()
        code, err = finish(agent(tmp_path, "--server", f"http://127.0.0.1:{port}", "--token", "t"))
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: cannot reach the server at http://127.0.0.1:{port}: "), err
    assert "no HTTP answer" in err[0]
    assert time.monotonic() - started < 15  # not asked again: another service on that port stays one


def test_a_rejected_token_is_one_line(tmp_path):
    with FakeSite({"nano-0": "cred"}, tokens={"good": "nano-0"}) as site:
        code, err = finish(agent(tmp_path, "--server", site.http_url, "--token", "bad"))
    assert code == 2 and len(err) == 1 and "refused the enrollment token" in err[0], err


def test_a_python_without_the_agents_packages_says_how_to_run_it_and_keeps_the_token(tmp_path):
    # the command pasted on a board whose `python` is the system's: no websockets, no torch (-S: no site-packages)
    with FakeSite({"nano-0": "cred"}, tokens={"good": "nano-0"}) as site:
        proc = subprocess.run([sys.executable, "-S", "-m", "workers.agent", "--server", site.http_url, "--token",
                               "good"], cwd=ROOT, env={**os.environ, "HOME": str(tmp_path)}, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert "good" in site.tokens  # not spent: the same line works once run the right way
    err = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert "has no websockets" in err[0] and "make agent SERVER=" in err[0] and "still unused" in err[0], err


def test_the_pasted_make_agent_line_runs_the_agent_with_the_checkouts_python(tmp_path):
    # the site's *Add device* line, on a shell whose `python` is not the project's (first on PATH: one that fails);
    # the fake site's socket is on another port, so the agent is done once it enrolled
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'not the project python' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with FakeSite({"nano-0": "cred"}, tokens={"good": "nano-0"}) as site:
        line = f"make -s agent SERVER={site.http_url} TOKEN=good EMULATE=nano STATE={tmp_path / 'state.json'}"
        proc = subprocess.Popen(line.split(), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            site.wait(lambda: (tmp_path / "state.json").exists(), 60, "the agent's enrollment")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            code, err = finish(proc)
    assert "good" not in site.tokens and json.loads((tmp_path / "state.json").read_text())["credential"] == "cred"
    assert not any("Traceback" in line for line in err), err
    missing = subprocess.run(["make", "-s", "agent"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "make agent needs SERVER=" in missing.stderr, missing.stderr


def serve(tmp_path: Path, site: FakeSite, credential: str, *argv: str) -> subprocess.Popen:
    """An agent for the fake site's socket port, its credential already in a state file."""
    server = f"http://127.0.0.1:{site.ws_url.split(':')[2].split('/')[0]}"
    state = tmp_path / "state.json"
    save_state(state, State(server, credential, {"name": "tx2-0"}, token_digest("spent")))
    return agent(tmp_path, "--server", server, "--state", str(state), *argv)


def test_the_agent_says_hello_and_stops_cleanly_on_sigterm(tmp_path):
    with FakeSite({"tx2-0": "cred-tx2"}) as site:
        # the spent token of the state file is not sent again: the pasted command line can be re-run
        proc = serve(tmp_path, site, "cred-tx2", "--emulate", "tx2", "--token", "spent")
        try:
            (_, hello), *_ = site.wait(lambda: site.messages("tx2-0", "hello"), 30, "the agent's hello")
            site.wait(lambda: site.messages("tx2-0", "heartbeat"), 5, "a heartbeat")
        finally:
            proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code, err = finish(proc)
    assert code == 0 and time.monotonic() - started < 10
    assert not any("Traceback" in line for line in err), err
    assert any("connected to" in line and "as tx2-0" in line for line in err), err
    tx2 = KINDS["jetson-tx2"]
    assert (hello["kind"], hello["emulated"], hello["gflops"]) == ("jetson-tx2", True, tx2.gflops)
    assert hello["memory_bytes"] == int(tx2.memory_gb * 2**30) and hello["host_gflops"] > 0
    assert hello["address"] == "127.0.0.1" and hello["version"] == 1 and len(hello["session"]) >= 16
    assert json.loads((tmp_path / "state.json").read_text())["credential"] == "cred-tx2"


def test_a_refused_credential_ends_the_agent_with_one_error_line(tmp_path):
    with FakeSite({"tx2-0": "cred-tx2"}) as site:
        site.revoked.add("cred-old")
        code, err = finish(serve(tmp_path, site, "cred-old"))
    assert code == 2
    assert not any("Traceback" in line for line in err), err
    assert err[-1].startswith("error: the server refused this device's credential (close code 4401)"), err
    assert "enroll again with a new token" in err[-1]
