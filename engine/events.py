"""Timeline events, one plain-data form for the simulator, the runtime and the dashboard; Chrome-trace export.

The runtime's event stream is a sequence of JSON-ready dicts, each with a `type`:
`run-start` (plan, iterations), `device-start` (device, rank, stage, dilation), `step` (a StepEvent),
`iteration` (iteration, loss, iteration_s, throughput, late_steps, steps, time), `device-done`
(device, late_steps, steps, peak_memory_bytes), `device-error` (device, iteration, message, cause) and
`run-stop` (status; device, iteration and message when it failed). Times are device seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KINDS = ("F", "B", "send", "recv", "all-reduce")


@dataclass(frozen=True)
class StepEvent:
    """One step of one device: compute (F/B), a transfer (send/recv) or the stage's gradient all-reduce."""

    device: str
    stage: int
    micro_batch: int  # -1 for the all-reduce
    kind: str
    start: float  # seconds from the start of the iteration (or run)
    end: float
    peer: str = ""  # the other device of a send/recv
    iteration: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_message(self) -> dict:
        """The event as a message of the event stream: its fields plus `"type": "step"`."""
        return {"type": "step", **asdict(self)}

    @classmethod
    def from_message(cls, doc: dict) -> StepEvent:
        return cls(**{k: v for k, v in doc.items() if k != "type"})


def chrome_trace(events: list[StepEvent], devices: list[str], name: str = "asteroid", pid: int = 0) -> dict:
    """A Chrome-trace document (chrome://tracing, Perfetto): one row per device, times in microseconds."""
    tid = {d: k for k, d in enumerate(devices)}
    trace = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}]
    trace += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": d}} for d, t in tid.items()]
    for e in events:
        label = e.kind if e.micro_batch < 0 else f"{e.kind}{e.micro_batch}"
        trace.append(
            {
                "name": label if not e.peer else f"{label}->{e.peer}" if e.kind == "send" else f"{label}<-{e.peer}",
                "cat": e.kind,
                "ph": "X",
                "pid": pid,
                "tid": tid[e.device],
                "ts": e.start * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": {"stage": e.stage, "micro_batch": e.micro_batch},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def side_by_side(traces: list[dict]) -> dict:
    """Several Chrome traces (each made with its own `pid`) in one document, shown one above the other."""
    return {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms"}
