"""What `make agent` installs: requirements-agent.txt less the torch (and numpy) the system's Python already has.

    python workers/agentreqs.py requirements-agent.txt > .venv-agent/requirements.txt

Run by the agent's venv (made with --system-site-packages), before anything is installed in it: the standard library
only. A Jetson's torch comes with JetPack (NVIDIA's build, the one with CUDA) and a desktop's may be a CUDA build:
pip's `torch==...` would install another beside it and shadow it, so a torch that imports is kept, and the numpy it
was built against with it. Says on stderr which torch the agent will use and whether it sees a GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys

KEPT_WITH_SYSTEM_TORCH = ("torch", "numpy")


def system_torch() -> str | None:
    """ "VERSION cuda|cpu" of the torch this Python imports (from the system's site-packages), or None."""
    probe = "import torch; print(torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def requirements(text: str, have_torch: bool) -> list[str]:
    """The requirement lines to install: all of them, or, with a system torch, all but torch's and numpy's."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[\s=<>!~\[;]", line, maxsplit=1)[0].lower()
        if have_torch and name in KEPT_WITH_SYSTEM_TORCH:
            continue
        out.append(line)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python workers/agentreqs.py requirements-agent.txt", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = f.read()
    found = system_torch()
    if found:
        version, device = found.split()[:2]
        gpu = "sees a CUDA GPU" if device == "cuda" else "sees no GPU: the agent computes on the CPU"
        print(f"using the system's torch {version} ({gpu}); not installing torch or numpy", file=sys.stderr)
    else:
        print("no torch on this Python: installing torch from requirements-agent.txt (a CPU build on most "
              "machines; on a Jetson, install JetPack's torch first: docs/deployment.md)", file=sys.stderr)  # fmt: skip
    print("\n".join(requirements(text, bool(found))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
