"""The event catalogue: one dataclass per kind of event a run reports, shared by the runtime, agents and the site.

A run's event stream is a sequence of messages, JSON-ready dicts with a `type`:

| type           | sent by                    | what it says                                                      |
|----------------|----------------------------|-------------------------------------------------------------------|
| `run-start`    | launcher                   | the plan and the number of iterations                             |
| `device-start` | each device                | its rank, stage, dilation and pid; it is training                 |
| `step`         | each device                | one compute step, transfer or all-reduce (a `StepEvent`)          |
| `iteration`    | rank 0                     | an iteration's loss, device-time length and throughput            |
| `eval`         | rank 0                     | held-out loss and accuracy after an iteration (`--eval-every`)    |
| `device-done`  | each device                | its totals (late steps, peak memory); its stage's weights         |
| `device-error` | a device (or its agent)    | why it stopped: its own failure, or a lost peer                   |
| `job-stopped`  | an agent                   | its device's part ended without done/error (cancel, shutdown)     |
| `run-stop`     | launcher                   | how the run ended                                                 |
| `device-lost`  | coordinator                | a device died or stopped answering; when it was noticed          |
| `replan`       | coordinator                | a new generation's plan, and how long planning took (real s)     |
| `restore`      | a device                   | layers it got for the new generation, from whom, bytes, device s |
| `replay`       | coordinator                | iterations that run again after a rollback                       |
| `recovered`    | coordinator                | the run is back to new iterations: what the recovery cost        |
| `device-left`  | coordinator                | a device left gracefully at an iteration boundary                |
| `device-joined`| coordinator                | a new device joined at an iteration boundary                     |
| `repartition`  | coordinator                | measured speeds drifted from the plan's: re-planned on them      |

`Event.to_message()` gives the message; `parse(message)` (or `Kind.from_message`) checks one, field by
field, keeping only the catalogue's fields: a UserError names the field and what is wrong. Times are
device seconds unless a field ends in `real_s` (control-plane time, real seconds on the coordinator's host).
Every event of a generation carries `generation` (a new one per membership change); a replayed iteration's
event replaces the earlier one of the same number. A new kind is one dataclass here, added to `CATALOGUE`.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from engine.errors import UserError

KINDS = ("F", "B", "W", "send", "recv", "all-reduce")  # the kinds of a step (W: a deferred weight gradient)
MAX_INT = 2**63 - 1  # what a database's bigint column holds


class EventError(UserError):
    """A malformed event; the text says which field and why."""


class Event:
    """Base of the catalogue's dataclasses: the message form and its checked inverse."""

    TYPE: ClassVar[str]
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ()  # numeric fields that may not be below zero
    FRACTIONS: ClassVar[tuple[str, ...]] = ()  # numeric fields between 0 and 1
    UNSAID: ClassVar[tuple[str, ...]] = ()  # fields left out of the message while they hold their default

    def to_message(self) -> dict:
        """The event as a message of the event stream: `"type"` plus its fields."""
        message = {"type": self.TYPE, **asdict(self)}  # type: ignore[call-overload]
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in self.UNSAID and message[f.name] == f.default:
                del message[f.name]
        return message

    @classmethod
    def from_message(cls, doc: Any) -> Any:
        """The event in `doc`, checked; fields outside the catalogue are dropped."""
        if not isinstance(doc, dict):
            raise EventError(f"an event must be an object, got {type(doc).__name__}")
        if doc.get("type", cls.TYPE) != cls.TYPE:
            raise EventError(f"expected a {cls.TYPE!r} event, got {doc.get('type')!r}")
        values = {}
        for name, (types, required) in _schema(cls).items():
            if name not in doc:
                if required:
                    raise EventError(f"{cls.TYPE}: missing field {name!r}")
                continue
            value = doc[name]
            _check(cls.TYPE, name, value, types)
            if name in cls.NON_NEGATIVE and value is not None and value < 0:
                raise EventError(f"{cls.TYPE}: field {name!r} must not be negative")
            if name in cls.FRACTIONS and value is not None and not 0 <= value <= 1:
                raise EventError(f"{cls.TYPE}: field {name!r} must be between 0 and 1")
            values[name] = float(value) if float in types and type(value) is int else value
        return cls(**values)


@dataclass(frozen=True)
class RunStart(Event):
    TYPE = "run-start"

    plan: dict
    iterations: int


@dataclass(frozen=True)
class DeviceStart(Event):
    TYPE = "device-start"
    NON_NEGATIVE = ("rank", "stage")

    device: str
    rank: int
    stage: int
    dilation: float | None = None  # None: a real device, nothing padded
    pid: int = 0
    generation: int = 0
    setup_real_s: float = 0.0  # real seconds it took to form this generation's process groups


@dataclass(frozen=True)
class StepEvent(Event):
    """One step of one device: compute (F, B, W), a transfer (send/recv) or the stage's gradient all-reduce."""

    TYPE = "step"
    NON_NEGATIVE = ("stage", "start", "end", "iteration")

    device: str
    stage: int
    micro_batch: int  # -1 for the all-reduce
    kind: str
    start: float  # seconds from the start of the iteration (or run)
    end: float
    peer: str = ""  # the other device of a send/recv
    iteration: int = 0
    generation: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise EventError(f"step: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Iteration(Event):
    """An iteration every device finished: its loss, its length in device time, and the run's speed so far."""

    TYPE = "iteration"
    NON_NEGATIVE = ("iteration", "iteration_s", "throughput", "late_steps", "steps", "time", "measured_throughput")

    iteration: int
    loss: float | None  # the global batch's mean loss (negative for some losses); None: not finite (diverged)
    iteration_s: float
    throughput: float  # samples per device second of this iteration
    late_steps: int = 0  # over the run so far, every device
    steps: int = 0
    time: float = 0.0  # device seconds since the run started
    measured_throughput: float | None = None  # the run's measured throughput so far (`engine.metrics`)
    generation: int = 0


@dataclass(frozen=True)
class Eval(Event):
    """The model after an iteration, scored on the dataset's held-out split (forward only, through the pipeline)."""

    TYPE = "eval"
    NON_NEGATIVE = ("iteration", "samples", "device_s", "perplexity")
    FRACTIONS = ("accuracy",)

    iteration: int
    loss: float | None  # mean held-out loss per sample (per token for language models); None: not finite
    accuracy: float | None  # classification: the fraction right; None for language models
    perplexity: float | None  # language models: exp(loss); None for classification or an overflow
    samples: int
    device_s: float  # device seconds the evaluation took (left out of the iterations' times)
    generation: int = 0


@dataclass(frozen=True)
class DeviceDone(Event):
    """A device finished every iteration. `state_dict` (its stage's weights, `torch.save` bytes) travels
    only inside a host, from the device process to its launcher or agent; `part` says the agent uploaded it."""

    TYPE = "device-done"
    NON_NEGATIVE = ("late_steps", "steps", "overrun_s", "peak_memory_bytes", "wire_bytes", "payload_bytes")
    UNSAID = ("state_dict",)  # messages that leave the host never carry bytes

    device: str
    late_steps: int = 0
    steps: int = 0
    overrun_s: float = 0.0  # wall seconds late steps ran past their targets
    peak_memory_bytes: int = 0
    wire_bytes: int = 0  # activations and gradients it sent to other stages, as they crossed the links
    payload_bytes: int = 0  # the same tensors uncompressed (float32): wire_bytes / payload_bytes is the saving
    part: bool = False
    part_error: str = ""
    state_dict: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class DeviceError(Event):
    """A device stopped: `cause` "own" (its own failure) or "peer" (another device went away)."""

    TYPE = "device-error"

    device: str
    iteration: int  # -1: while starting
    message: str
    cause: str = "own"
    traceback: str = ""

    def __post_init__(self) -> None:
        if self.cause not in ("own", "peer"):
            raise EventError(f"device-error: cause must be 'own' or 'peer', got {self.cause!r}")


@dataclass(frozen=True)
class JobStopped(Event):
    """A device's part of a job ended without `device-done` or `device-error` of its own."""

    TYPE = "job-stopped"
    UNSAID = ("why",)

    device: str
    reason: str  # cancelled, agent-stopped, rejected, died, left (a coordinated device the coordinator let go)
    why: str = ""  # how a process that died ended: "died (SIGKILL)" (a coordinated run's lost device)


@dataclass(frozen=True)
class RunStop(Event):
    TYPE = "run-stop"
    UNSAID = ("device", "iteration", "message")

    status: str  # completed or failed
    wall_s: float = 0.0
    device: str = ""  # when it failed: the device that caused it, the iteration and why
    iteration: int = -1
    message: str = ""


@dataclass(frozen=True)
class DeviceLost(Event):
    """A device died or stopped answering during `iteration` (1-based: the one in progress)."""

    TYPE = "device-lost"
    NON_NEGATIVE = ("detected_real_s",)

    device: str
    iteration: int
    cause: str  # "died (SIGKILL)", "no heartbeat for 2.0 s", ...
    detected_real_s: float = 0.0  # real seconds from the failure (or last heartbeat) to the coordinator noticing
    generation: int = 0


@dataclass(frozen=True)
class Replan(Event):
    """Generation `generation` trains `plan`; planning it took `planning_real_s`."""

    TYPE = "replan"
    NON_NEGATIVE = ("generation", "planning_real_s", "predicted_throughput", "start")

    generation: int
    plan: dict
    planning_real_s: float
    reason: str  # lost, left, joined, repartition, resumed
    predicted_throughput: float = 0.0
    start: int = 0  # the iterations already done when it starts (it trains iteration start + 1 on)


@dataclass(frozen=True)
class Restore(Event):
    """`device` got layers [start, end) as of iteration `iteration` (completed) from `source`."""

    TYPE = "restore"
    NON_NEGATIVE = ("start", "end", "iteration", "bytes", "device_s")

    device: str
    start: int
    end: int
    source: str  # a device name, or "central" (the coordinator's replica), or "seed" (initial weights)
    copy: str  # live, snapshot, replica, central, seed
    iteration: int
    bytes: int = 0
    device_s: float = 0.0
    generation: int = 0


@dataclass(frozen=True)
class Replay(Event):
    """Iterations `first`..`last` (1-based, inclusive) run again after a rollback."""

    TYPE = "replay"

    first: int
    last: int
    generation: int = 0


@dataclass(frozen=True)
class Recovered(Event):
    """The first iteration after a failure completed; what the recovery cost, split into its steps."""

    TYPE = "recovered"
    NON_NEGATIVE = (
        "generation", "real_s", "device_s", "wall_s", "detection_real_s", "planning_real_s", "setup_real_s",
        "restore_device_s", "replay_device_s", "throughput_before", "throughput_after",
    )  # fmt: skip

    generation: int
    real_s: float  # control plane, real seconds: detection (until every survivor paused) + planning + new groups
    device_s: float  # data plane, device seconds: restore + replayed compute (never added to real seconds)
    wall_s: float = 0.0  # the host's wall clock from the failure to the interrupted iteration done again
    detection_real_s: float = 0.0
    planning_real_s: float = 0.0
    setup_real_s: float = 0.0
    restore_device_s: float = 0.0
    replay_device_s: float = 0.0
    iterations_lost: int = 0
    throughput_before: float = 0.0
    throughput_after: float = 0.0
    summary: str = ""
    iteration: int = 0  # the interrupted iteration (1-based), completed again


@dataclass(frozen=True)
class DeviceLeft(Event):
    TYPE = "device-left"

    device: str
    iteration: int  # the last iteration it took part in (1-based)
    generation: int = 0


@dataclass(frozen=True)
class DeviceJoined(Event):
    TYPE = "device-joined"

    device: str
    kind: str
    iteration: int  # it trains from the next iteration on (1-based: the last one before it joined)
    generation: int = 0


@dataclass(frozen=True)
class Repartition(Event):
    """Measured speeds drifted from the plan: `speeds` is each drifting device's measured slow-down factor;
    `refitted` the probed devices whose latency-predictor correction was refitted on their measured steps."""

    TYPE = "repartition"

    iteration: int
    speeds: dict
    measured_iteration_s: float
    predicted_iteration_s: float
    generation: int = 0
    refitted: list = field(default_factory=list)


CATALOGUE: dict[str, type[Event]] = {
    kind.TYPE: kind
    for kind in (
        RunStart,
        DeviceStart,
        StepEvent,
        Iteration,
        Eval,
        DeviceDone,
        DeviceError,
        JobStopped,
        RunStop,
        DeviceLost,
        Replan,
        Restore,
        Replay,
        Recovered,
        DeviceLeft,
        DeviceJoined,
        Repartition,
    )  # fmt: skip
}


def parse(doc: Any, kinds: typing.Iterable[str] | None = None) -> Event:
    """The event in a message, checked against the catalogue (and limited to `kinds` when given)."""
    kind = doc.get("type") if isinstance(doc, dict) else None
    allowed = CATALOGUE if kinds is None else {k: CATALOGUE[k] for k in kinds}
    if not isinstance(kind, str) or kind not in allowed:
        raise EventError(f"unknown event type {str(kind)[:40]!r}; expected one of {', '.join(allowed)}")
    return allowed[kind].from_message(doc)


# -- checking fields -------------------------------------------------------------------------------------------

_SCHEMAS: dict[type, dict[str, tuple[tuple[type, ...], bool]]] = {}


def _schema(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """{field: (accepted types, required)} from the dataclass's annotations."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        schema = {}
        for f in fields(cls):
            hint = hints[f.name]
            types = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
            required = f.default is MISSING and f.default_factory is MISSING
            schema[f.name] = (tuple(typing.get_origin(t) or t for t in types), required)
        _SCHEMAS[cls] = schema
    return _SCHEMAS[cls]


_UnionType = type(int | None)


def _check(kind: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None and type(None) in types:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if bool in types:
        ok = isinstance(value, bool)
    elif int in types or float in types:
        ok = number and (float in types or isinstance(value, int))
        big = isinstance(value, int) and abs(value) > MAX_INT
        if ok and (big or isinstance(value, float) and not math.isfinite(value)):
            raise EventError(f"{kind}: field {name!r} must be a finite number within 64 bits, got {str(value)[:20]}")
    else:
        ok = isinstance(value, types)
    if not ok:
        expected = " or ".join(t.__name__ for t in types)
        raise EventError(f"{kind}: field {name!r} has the wrong type ({type(value).__name__}; expected {expected})")
