"""Output paths of the commands (--save, --events, --trace, --output ...), checked before any work starts: a
mistyped path is one line at once, not an error after a whole run."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import UserError


def check_output(option: str, path: str | None, make_dirs: bool = False) -> None:
    """UserError unless the file `path` (given to `option`; None or empty: not asked for) can be written: it is
    no directory and it sits in a writable directory. `make_dirs`: the command creates missing directories, so
    the nearest one that exists must be writable."""
    if not path:
        return
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{option} {path} is a directory; give a file name")
    if file.exists() and not os.access(file, os.W_OK):
        raise UserError(f"{option} {path}: no permission to write that file")
    _check_directory(option, path, file.parent, make_dirs)


def check_output_dir(option: str, path: str | None) -> None:
    """UserError unless the directory `path` (given to `option`) is one, or can be made, and can be written in."""
    if not path:
        return
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {path} is a file, not a directory")
    _check_directory(option, path, folder, make_dirs=True)


def _check_directory(option: str, path: str, folder: Path, make_dirs: bool) -> None:
    if make_dirs:
        while not folder.exists() and folder != folder.parent:  # the nearest one that exists: it gets the new ones
            folder = folder.parent
    if not folder.exists():
        raise UserError(f"{option} {path}: directory {folder} does not exist")
    if not folder.is_dir():
        raise UserError(f"{option} {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: no permission to write in {folder}")


def check_distinct(outputs) -> None:
    """UserError if two of `outputs` ((option, path or None) pairs) name the same file: one would overwrite the
    other, yet both would be reported written."""
    seen: dict[Path, str] = {}
    for option, path in outputs:
        if not path:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise UserError(f"{seen[key]} and {option} name the same file {path}: give each its own")
        seen[key] = option
