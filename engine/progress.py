"""A tiny progress reporter on stderr: a bar on a terminal, one summary line otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts `total` steps of a task named `desc`.

    On a TTY it redraws one line (`desc [#####-----] 5/10 note`); elsewhere it stays silent
    until `close()`, which prints one line with the elapsed time. Disabled, it prints nothing.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, stream: TextIO | None = None, width: int = 30):
        self.total = max(total, 1)
        self.desc = desc
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.closed = False

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if self.tty:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.desc} [{bar}] {self.done}/{self.total} {note[:40]:<40}")
            self.stream.flush()

    def close(self) -> None:
        if self.closed or not self.enabled:
            self.closed = True
            return
        self.closed = True
        elapsed = time.perf_counter() - self.start
        prefix = "\r" if self.tty else ""
        self.stream.write(f"{prefix}{self.desc}: {self.done}/{self.total} done in {elapsed:.1f}s{' ' * 40}\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
