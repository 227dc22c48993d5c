"""`python -m workers.testbed` without building anything: one-line refusals before a testbed is made, and SIGTERM
taking the same teardown path as Ctrl-C (a stand-in testbed records what was torn down)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workers.testbed.bench as bench
from workers.testbed.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


class NeverBuilt:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a testbed was built before the arguments were checked")


@pytest.mark.parametrize(
    "where, message",
    [
        ("/nonexistent-dir/x.json", "cannot write --json /nonexistent-dir/x.json: there is no directory"),
        (".", "cannot write --json .: it is a directory"),
    ],
)
def test_bench_refuses_an_output_path_it_cannot_write_before_building_anything(monkeypatch, capsys, where, message):
    monkeypatch.setattr(bench, "Testbed", NeverBuilt)
    assert main(["bench", "--json", where]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# The bench (and every verb) run with a stand-in testbed whose up() records itself and whose lab waits forever:
# SIGTERM must end it like Ctrl-C, through the teardown, exit 130, no traceback.
STAND_IN = """
import sys, time
from pathlib import Path
import workers.testbed.bench as bench
from workers.testbed.__main__ import main

marks = Path(sys.argv[1])

class Testbed:
    boards = []
    def __init__(self, **kwargs):
        pass
    def up(self):
        marks.write_text("up\\n")
    def down(self):
        marks.write_text(marks.read_text() + "down\\n")

class Lab:
    def __init__(self, *args, **kwargs):
        pass
    def __enter__(self):
        print("ready", flush=True)
        time.sleep(60)
    def __exit__(self, *exc):
        marks.write_text(marks.read_text() + "lab closed\\n")

bench.Testbed, bench.Lab = Testbed, Lab
raise SystemExit(main(["bench", "--json", sys.argv[2]]))
"""


def test_sigterm_tears_the_bench_down_like_ctrl_c(tmp_path):
    marks = tmp_path / "marks"
    proc = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(marks), str(tmp_path / "out.json")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert marks.read_text().splitlines() == ["up", "down"]
