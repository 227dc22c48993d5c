"""Supervised children (webapp/children.py): started again after a crash, until they keep crashing."""

import sys

import pytest

from webapp.children import CrashLoop, Supervised, stop

pytestmark = pytest.mark.multiprocess


def test_a_crashing_child_is_started_again_until_it_crashes_too_often():
    child = Supervised("the crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], limit=3, window_s=60)
    said = []
    with pytest.raises(CrashLoop, match=r"the crasher exited with code 3 \(3 exits within 60 s\)"):
        while True:
            child.proc.wait(10)
            said.append(child.revive())
    assert said == [f"the crasher exited with code 3; started it again (pid {p})" for p in _pids(said)]
    assert len(said) == 2


def test_a_running_child_is_left_alone_and_stopped_on_request():
    child = Supervised("the sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.revive() is None
    finally:
        assert stop(child.proc, timeout=5) != 0


def _pids(lines):
    return [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in lines]
