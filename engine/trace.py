"""Step events as Chrome traces (chrome://tracing, Perfetto): the simulated or measured timeline of a run."""

from __future__ import annotations

from engine.events import StepEvent


def chrome_trace(events: list[StepEvent], devices: list[str], name: str = "asteroid", pid: int = 0) -> dict:
    """A Chrome-trace document (chrome://tracing, Perfetto): one row per device, times in microseconds."""
    tid = {d: k for k, d in enumerate(devices)}
    for e in events:  # a device the list does not name still gets a row of its own
        tid.setdefault(e.device, len(tid))
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
