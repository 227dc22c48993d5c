"""The catalogue's fault-tolerance events: a run's devices or plan changing, as its coordinator reports them
(and the layers a device restores). Part of the catalogue in engine/events.py; import them from there."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.eventbase import Event


@dataclass(frozen=True)
class DeviceLost(Event):
    """A device died or stopped answering during `iteration` (1-based: the one in progress)."""

    TYPE = "device-lost"
    SENT_BY, LOG, CHANGE = "coordinator", "error", True
    NON_NEGATIVE = ("detected_real_s",)

    device: str
    iteration: int
    cause: str  # "died (SIGKILL)", "no heartbeat for 2.0 s", ...
    detected_real_s: float = 0.0  # real seconds from the failure (or last heartbeat) to the coordinator noticing
    generation: int = 0

    def line(self) -> str:
        return (
            f"device {self.device} lost at iteration {self.iteration} ({self.cause}); noticed in "
            f"{self.detected_real_s:.1f} s"
        )

    def mark(self) -> dict:
        return {"x": self.iteration - 0.5, "text": f"{self.device} lost", "tone": "bad"}


@dataclass(frozen=True)
class Replan(Event):
    """Generation `generation` trains `plan`; planning it took `planning_real_s`."""

    TYPE = "replan"
    SENT_BY, LOG, CHANGE = "coordinator", "info", True
    NON_NEGATIVE = ("generation", "planning_real_s", "predicted_throughput", "start")

    generation: int
    plan: dict
    planning_real_s: float
    reason: str  # lost, left, joined, repartition, resumed
    predicted_throughput: float = 0.0
    start: int = 0  # the iterations already done when it starts (it trains iteration start + 1 on)

    def line(self) -> str:
        stages = self.plan.get("stages", [])
        names = sorted({d["name"] for st in stages for d in st["devices"]})
        return (
            f"re-planned in {self.planning_real_s:.1f} s ({self.reason}): generation {self.generation}, "
            f"{len(stages)} stage{'s' if len(stages) != 1 else ''} on {', '.join(names)}, "
            f"{self.predicted_throughput:.1f} samples/s predicted"
        )


@dataclass(frozen=True)
class Restore(Event):
    """`device` got layers [start, end) as of iteration `iteration` (completed) from `source`."""

    TYPE = "restore"
    CHANGE = True
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
    SENT_BY, LOG, CHANGE = "coordinator", "warning", True

    first: int
    last: int
    generation: int = 0

    def line(self) -> str:
        which = f"iteration {self.first}" if self.first == self.last else f"iterations {self.first}-{self.last}"
        return f"rolled back: replaying {which}"


@dataclass(frozen=True)
class Recovered(Event):
    """The first iteration after a failure completed; what the recovery cost, split into its steps."""

    TYPE = "recovered"
    SENT_BY, LOG, CHANGE = "coordinator", "info", True
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

    def line(self) -> str:
        return f"recovered: {self.summary}"

    def mark(self) -> dict:
        return {"x": self.iteration, "text": "recovered", "tone": "good"}


@dataclass(frozen=True)
class DeviceLeft(Event):
    TYPE = "device-left"
    SENT_BY, LOG, CHANGE = "coordinator", "info", True

    device: str
    iteration: int  # the last iteration it took part in (1-based)
    generation: int = 0

    def line(self) -> str:
        return f"device {self.device} left after iteration {self.iteration}, its layers handed over"

    def mark(self) -> dict:
        return {"x": self.iteration + 0.5, "text": f"{self.device} left", "tone": "warn"}


@dataclass(frozen=True)
class DeviceJoined(Event):
    TYPE = "device-joined"
    SENT_BY, LOG, CHANGE = "coordinator", "info", True

    device: str
    kind: str
    iteration: int  # it trains from the next iteration on (1-based: the last one before it joined)
    generation: int = 0

    def line(self) -> str:
        return f"device {self.device} ({self.kind}) joined after iteration {self.iteration}"

    def mark(self) -> dict:
        return {"x": self.iteration + 0.5, "text": f"{self.device} joined", "tone": "info"}


@dataclass(frozen=True)
class DeviceStandby(Event):
    """A device of the run that the new plan leaves out although nobody asked it to leave: the re-plan on the
    devices there are found no faster plan that uses it. It hands over its layers (if it held any) and stands by:
    every later re-plan may take it again."""

    TYPE = "device-standby"
    SENT_BY, LOG, CHANGE = "coordinator", "info", True

    device: str
    iteration: int  # the last iteration it took part in (1-based; 0 if it never trained in this stint)
    planned_on: int  # how many devices the new plan uses
    generation: int = 0

    def line(self) -> str:
        return (
            f"device {self.device} stands by after iteration {self.iteration}: the re-plan found no faster plan that "
            f"uses it (the new plan uses {self.planned_on} device{'s' if self.planned_on != 1 else ''}); it is "
            "planned on again at the next change"
        )

    def mark(self) -> dict:
        return {"x": self.iteration + 0.5, "text": f"{self.device} stands by", "tone": "info"}


@dataclass(frozen=True)
class Repartition(Event):
    """Measured speeds drifted from the plan: `speeds` is each drifting device's measured slow-down factor;
    `refitted` the probed devices whose latency-predictor correction was refitted on their measured steps."""

    TYPE = "repartition"
    SENT_BY, LOG, CHANGE = "coordinator", "warning", True

    iteration: int
    speeds: dict
    measured_iteration_s: float
    predicted_iteration_s: float
    generation: int = 0
    refitted: list = field(default_factory=list)

    def line(self) -> str:
        slow = ", ".join(f"{name} computes {factor:.1f}x its planned time" for name, factor in self.speeds.items())
        learned = f"; predictions refitted for {', '.join(map(str, self.refitted))}" if self.refitted else ""
        return (
            f"re-partitioned after iteration {self.iteration}: {slow}; iterations took "
            f"{self.measured_iteration_s:.2f} s against {self.predicted_iteration_s:.2f} s predicted, so the plan "
            f"now gives the slow devices less work{learned}"
        )
