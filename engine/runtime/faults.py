"""Faults and membership changes to inject into a run: `--fail DEV@IT[:PHASE]`, `--leave DEV@IT`,
`--join KIND@IT`, `--slow DEV@IT:FACTOR` (iterations count from 1, as everywhere users see them).

A failure is real: the device process SIGKILLs itself when it reaches PHASE of iteration IT for the first time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.devices import Cluster, Device, get_kind
from engine.errors import UserError

PHASES = ("forward", "backward", "all-reduce", "send", "replica")
# --slow's largest factor: a board slowed further would fall below a cluster file's least GFLOPS
# (engine.devices.LIMITS), and its re-plan's cluster could not be read back
MAX_SLOWDOWN = 10_000


@dataclass(frozen=True)
class Fail:
    device: str
    iteration: int
    phase: str = "forward"


@dataclass(frozen=True)
class Leave:
    device: str
    iteration: int  # it finishes this iteration, hands over its layers and exits


@dataclass(frozen=True)
class Join:
    kind: str
    iteration: int  # it joins after this iteration
    device: Device | None = None  # a named device (a site's); None: a new one of `kind`, named after it


@dataclass(frozen=True)
class Slow:
    device: str
    iteration: int  # from this iteration on
    factor: float


@dataclass(frozen=True)
class Faults:
    fail: tuple[Fail, ...] = ()
    leave: tuple[Leave, ...] = ()
    join: tuple[Join, ...] = ()
    slow: tuple[Slow, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.fail or self.leave or self.join or self.slow)

    def check(self, cluster: Cluster, iterations: int) -> None:
        """Every device named is in the cluster and every iteration within the run."""
        for f in (*self.fail, *self.leave, *self.slow):
            cluster.device(f.device)
        for f in (*self.fail, *self.leave, *self.join, *self.slow):
            if not 1 <= f.iteration <= iterations:
                raise UserError(f"fault at iteration {f.iteration}: the run has iterations 1 to {iterations}")
        for j in self.join:
            if j.iteration >= iterations:
                raise UserError(f"--join {j.kind}@{j.iteration}: a device joins after an iteration before the last")

    def fails_of(self, device: str) -> tuple[Fail, ...]:
        return tuple(f for f in self.fail if f.device == device)


def _split(flag: str, text: str, what: str) -> tuple[str, str]:
    name, at, rest = text.partition("@")
    if not at or not name or not rest:
        raise UserError(f"{flag} must look like {what}, got {text!r}")
    return name, rest


def _iteration(flag: str, text: str, value: str) -> int:
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
        raise UserError(f"{flag} {text!r}: the iteration must be a whole number from 1, got {value!r}")
    return int(value)


def parse_fail(text: str) -> Fail:
    name, rest = _split("--fail", text, "DEV@IT[:PHASE]")
    it, _, phase = rest.partition(":")
    phase = phase or "forward"
    if phase not in PHASES:
        raise UserError(f"--fail {text!r}: phase must be one of {', '.join(PHASES)}, got {phase!r}")
    return Fail(name, _iteration("--fail", text, it), phase)


def parse_leave(text: str) -> Leave:
    name, it = _split("--leave", text, "DEV@IT")
    return Leave(name, _iteration("--leave", text, it))


def parse_join(text: str) -> Join:
    kind, it = _split("--join", text, "KIND@IT")
    get_kind(kind)  # an unknown kind names the known ones
    return Join(kind, _iteration("--join", text, it))


def parse_slow(text: str) -> Slow:
    name, rest = _split("--slow", text, "DEV@IT:FACTOR")
    it, colon, factor = rest.partition(":")
    try:
        value = float(factor) if colon else float("nan")
    except ValueError:
        value = float("nan")
    if not 1 <= value <= MAX_SLOWDOWN:
        raise UserError(f"--slow {text!r}: FACTOR must be a number from 1 to {MAX_SLOWDOWN:g}, got {factor!r}")
    return Slow(name, _iteration("--slow", text, it), value)


@dataclass
class FaultArgs:
    """The CLI's repeated flags, parsed."""

    fail: list[str] = field(default_factory=list)
    leave: list[str] = field(default_factory=list)
    join: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)

    def parse(self) -> Faults:
        return Faults(
            tuple(map(parse_fail, self.fail)),
            tuple(map(parse_leave, self.leave)),
            tuple(map(parse_join, self.join)),
            tuple(map(parse_slow, self.slow)),
        )
