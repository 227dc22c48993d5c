"""The event catalogue: one dataclass per kind of event a run reports, shared by the runtime, agents and the site.

A run's event stream is a sequence of messages, JSON-ready dicts with a `type`:

| type           | sent by                    | what it says                                                      |
|----------------|----------------------------|-------------------------------------------------------------------|
| `run-start`    | launcher                   | the plan and the number of iterations                             |
| `device-start` | each device                | its rank, stage, dilation, pid and compute device; it is training |
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
| `device-standby`| coordinator               | a re-plan left a device out that nobody asked to leave           |
| `repartition`  | coordinator                | measured speeds drifted from the plan's: re-planned on them      |

`Event.to_message()` gives the message; `parse(message)` (or `Kind.from_message`) checks one, field by
field, keeping only the catalogue's fields: a UserError names the field and what is wrong. Times are
device seconds unless a field ends in `real_s` (control-plane time, real seconds on the coordinator's host).
Every event of a generation carries `generation` (a new one per membership change); a replayed iteration's
event replaces the earlier one of the same number.

Each kind carries what the rest of the system does with it, so that a new kind is one dataclass here, added
to `CATALOGUE`: who sends it (`SENT_BY`: the site's agent protocol accepts the kinds of devices and agents,
its coordinator stores its own), its one log sentence (`line()`, said by the CLI and the site's job log at
`level()`), whether the live page's throughput chart marks it (`mark()`), and whether it changes the run's
devices or plan (`CHANGE`: kept in the run's record). The site relays every kind to the job's browsers, which
draw what they know and ignore the rest.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.changes import (
    DeviceJoined,
    DeviceLeft,
    DeviceLost,
    DeviceStandby,
    Recovered,
    Repartition,
    Replan,
    Replay,
    Restore,
)
from engine.eventbase import Event, EventError

KINDS = ("F", "B", "W", "send", "recv", "all-reduce")  # the kinds of a step (W: a deferred weight gradient)


@dataclass(frozen=True)
class RunStart(Event):
    TYPE = "run-start"
    SENT_BY = "launcher"

    plan: dict
    iterations: int


@dataclass(frozen=True)
class DeviceStart(Event):
    TYPE = "device-start"
    LOG = "info"
    NON_NEGATIVE = ("rank", "stage")

    device: str
    rank: int
    stage: int
    dilation: float | None = None  # None: a real device, nothing padded
    pid: int = 0
    generation: int = 0
    setup_real_s: float = 0.0  # real seconds it took to form this generation's process groups
    compute: str = ""  # where its stage computes (engine.runtime.placement): "cpu", "cuda:0 (NVIDIA Orin)"

    def line(self) -> str:
        where = f", on {self.compute}" if self.compute else ""
        dilation = f"time dilation {self.dilation or 1:.1f}"
        return f"{self.device} started: rank {self.rank}, stage {self.stage}, {dilation}{where}"


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
    measured_throughput: float | None = None  # this generation's (plan's) measured throughput so far (`engine.metrics`)
    generation: int = 0
    skipped: bool = False  # fp16: a gradient overflowed on some stage, so no stage stepped (engine.runtime.precision)
    loss_scale: float | None = None  # fp16: the loss scale every stage agreed on after this iteration


@dataclass(frozen=True)
class Diverged(Event):
    """The run diverged in `iteration` (1-based): its loss is not a number, or its held-out loss is past chance's
    (engine.recipe.divergence). Said once; the run stops when its options say so (`stop_on_divergence`)."""

    TYPE = "diverged"
    SENT_BY, LOG = "coordinator", "warning"

    iteration: int
    why: str
    stopped: bool = False

    def line(self) -> str:
        then = "the run stops (stop on divergence)" if self.stopped else "it goes on"
        return (
            f"the run diverged at iteration {self.iteration}: {self.why}; {then}. Lower the learning rate, or warm "
            "up and clip (the recipe: docs/training.md)"
        )

    def mark(self) -> dict:
        return {"x": self.iteration, "text": "diverged", "tone": "bad"}


@dataclass(frozen=True)
class Eval(Event):
    """The model after an iteration, scored on the dataset's held-out split (forward only, through the pipeline)."""

    TYPE = "eval"  # its line is the CLI's; the live page charts it instead
    NON_NEGATIVE = ("iteration", "samples", "device_s", "perplexity")
    FRACTIONS = ("accuracy",)

    iteration: int
    loss: float | None  # mean held-out loss per sample (per token for language models); None: not finite
    accuracy: float | None  # classification: the fraction right; None for language models
    perplexity: float | None  # language models: exp(loss); None for classification or an overflow
    samples: int
    device_s: float  # device seconds the evaluation took (left out of the iterations' times)
    generation: int = 0

    def score(self) -> str:
        """The held-out score in words: accuracy or perplexity, and the loss."""
        loss = "not finite" if self.loss is None else f"{self.loss:.4f}"
        if self.accuracy is not None:
            return f"accuracy {self.accuracy:.1%}, loss {loss}"
        if self.perplexity is not None:
            return f"perplexity {self.perplexity:.2f}, loss {loss}"
        return f"loss {loss}"

    def line(self) -> str:
        return (
            f"held-out after iteration {self.iteration + 1}: {self.score()} "
            f"({self.samples} samples, {self.device_s:.2f} s device)"
        )


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

    def level(self) -> str:
        return "error" if self.cause == "own" else "warning"

    def line(self) -> str:
        where = f" during iteration {self.iteration + 1}" if self.iteration >= 0 else " while starting"
        if self.cause == "own":
            return f"device {self.device} failed{where}: {self.message}"
        return f"{self.device} stopped{where}: {self.message}"


@dataclass(frozen=True)
class JobStopped(Event):
    """A device's part of a job ended without `device-done` or `device-error` of its own."""

    TYPE = "job-stopped"
    SENT_BY = "agent"
    UNSAID = ("why",)

    device: str
    reason: str  # cancelled, agent-stopped, rejected, died, left (a coordinated device the coordinator let go)
    why: str = ""  # how a process that died ended: "died (SIGKILL)" (a coordinated run's lost device)


@dataclass(frozen=True)
class AgentLog(Event):
    """A line of a board's agent log about a job (workers/joblog.py): the site keeps them per device, for the live
    page to show and download. Not in the job's own log."""

    TYPE = "agent-log"
    SENT_BY = "agent"
    NON_NEGATIVE = ("time",)

    device: str
    severity: str  # the logging level's name: INFO, WARNING, ERROR
    message: str
    time: float  # unix seconds on the board


@dataclass(frozen=True)
class RunStop(Event):
    TYPE = "run-stop"
    SENT_BY = "launcher"
    UNSAID = ("device", "iteration", "message")

    status: str  # completed or failed
    wall_s: float = 0.0
    device: str = ""  # when it failed: the device that caused it, the iteration and why
    iteration: int = -1
    message: str = ""


CATALOGUE: dict[str, type[Event]] = {
    kind.TYPE: kind
    for kind in (
        RunStart,
        DeviceStart,
        StepEvent,
        Iteration,
        Eval,
        Diverged,
        DeviceDone,
        DeviceError,
        JobStopped,
        AgentLog,
        RunStop,
        DeviceLost,
        Replan,
        Restore,
        Replay,
        Recovered,
        DeviceLeft,
        DeviceJoined,
        DeviceStandby,
        Repartition,
    )  # fmt: skip
}


def sent_by(*senders: str) -> tuple[str, ...]:
    """The kinds that `senders` ("device", "agent", "coordinator", "launcher") send, in catalogue order."""
    return tuple(kind for kind, cls in CATALOGUE.items() if cls.SENT_BY in senders)


def marked() -> tuple[str, ...]:
    """The kinds the live page's throughput chart marks."""
    return tuple(kind for kind, cls in CATALOGUE.items() if cls.mark is not Event.mark)


def said(message: dict) -> str | None:
    """The line of an event message (what the CLI prints), or None when its kind has none."""
    kind = CATALOGUE.get(message.get("type"))
    if kind is None or kind.line is Event.line:  # (steps, most of a run's events, have none: not parsed)
        return None
    return kind.from_message(message).line()


def parse(doc: Any, kinds: typing.Iterable[str] | None = None) -> Event:
    """The event in a message, checked against the catalogue (and limited to `kinds` when given)."""
    kind = doc.get("type") if isinstance(doc, dict) else None
    allowed = CATALOGUE if kinds is None else {k: CATALOGUE[k] for k in kinds}
    if not isinstance(kind, str) or kind not in allowed:
        raise EventError(f"unknown event type {str(kind)[:40]!r}; expected one of {', '.join(allowed)}")
    return allowed[kind].from_message(doc)
