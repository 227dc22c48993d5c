"""What `make agent` installs: requirements-agent.txt less the torch (and numpy) the system's Python already has.

    python workers/agentreqs.py requirements-agent.txt > .venv-agent/requirements.txt

Run by the agent's venv (made with --system-site-packages), before anything is installed in it: the standard library
only. A Jetson's torch comes with JetPack (NVIDIA's build, the one with CUDA) and a desktop's may be a CUDA build:
pip's `torch==...` would install another beside it and shadow it, so a torch that imports is kept, and the numpy it
was built against with it (pinned, so nothing replaces it either). Says on stderr which torch the agent will use
and whether it sees a GPU; refuses a torch older than the runtime needs.
"""

from __future__ import annotations

import re
import subprocess
import sys

KEPT_WITH_SYSTEM_TORCH = ("torch", "numpy")
# torch.distributed.pipelining's split backward (the zero-bubble schedules) and the CUDA calls the runtime makes
MIN_TORCH = (2, 5)


def system_torch() -> tuple[str, str, str] | None:
    """(torch's version, "cuda" or "cpu", numpy's version) of the torch this Python imports (the system's), or None."""
    probe = (
        "import numpy, torch; "
        "print(torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu', numpy.__version__)"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    return (words[0], words[1], words[2]) if done.returncode == 0 and len(words) == 3 else None


def too_old(version: str) -> bool:
    """A torch older than MIN_TORCH ("2.3.0a0+6ddf5cf85e.nv24.04": NVIDIA's local versions read by their numbers)."""
    numbers = re.findall(r"\d+", version.split("+")[0])[:2]
    return tuple(int(n) for n in numbers) < MIN_TORCH


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


def say(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python workers/agentreqs.py requirements-agent.txt", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = f.read()
    found = system_torch()
    if found:
        version, device, numpy = found
        if too_old(version):
            need = ".".join(map(str, MIN_TORCH))
            fix = "install a newer one for this Python (a Jetson: NVIDIA's torch for JetPack 6.1 or later)"
            say(f"error: the system's torch {version} is older than the {need} Asteroid's device processes need; {fix}")
            return 2
        gpu = "sees a CUDA GPU" if device == "cuda" else "sees no GPU: the agent computes on the CPU"
        say(f"using the system's torch {version} ({gpu}) and numpy {numpy}: installing neither")
    else:
        jetson = "a CPU build on most machines; on a Jetson, install JetPack's torch first: docs/deployment.md"
        say(f"no torch on this Python: installing torch from requirements-agent.txt ({jetson})")
    lines = requirements(text, bool(found))
    if found:  # the numpy that torch was built against, kept: a package asking for another is a clear pip error
        lines.append(f"numpy=={found[2]}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
