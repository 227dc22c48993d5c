"""A benchmark's `--record` file: its runs (dataclasses) as JSON, rewritten after each run, and read back."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from engine.errors import UserError


def write_record(path: Path | None, runs: list) -> None:
    """Every run so far to `path` (none: nothing), so a long benchmark that is stopped keeps what it measured."""
    if path is not None:
        path.write_text(json.dumps([asdict(r) for r in runs], indent=1))


def read_records(paths: list[Path], run: type, key: Callable, what: str) -> list:
    """The runs of `what` records (dataclass `run`); a later run with the same `key` replaces an earlier one, in
    its place. A missing or unreadable record is one UserError."""
    found: dict = {}
    for path in paths:
        try:
            loaded = [run(**doc) for doc in json.loads(path.read_text())]
        except FileNotFoundError:
            raise UserError(f"record {path} does not exist") from None
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"record {path} is not a {what} record: {exc}") from None
        for r in loaded:
            found[key(r)] = r
    return list(found.values())
