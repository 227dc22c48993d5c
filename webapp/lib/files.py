"""Files only this user reads (mode 0600), written whole: once (the first process wins), or replaced."""

from __future__ import annotations

import os
from pathlib import Path


def _temporary(path: Path, data: bytes) -> Path:
    """`data` in a private file beside `path` (this process's own name)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def write_once(path: Path, data: bytes) -> None:
    """Write `path` unless it exists (then keep the one there): link() fails on an existing file, so processes
    starting at once agree on the first complete one."""
    tmp = _temporary(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def replace(path: Path, data: bytes) -> None:
    """Write `path` whole, in place of what was there."""
    os.replace(_temporary(path, data), path)
