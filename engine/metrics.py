"""How a run's speed is measured: the one definition the CLI, the benchmarks, the runtime and the site report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def measured_iteration_s(iteration_s: Sequence[float]) -> float | None:
    """The median device-time iteration, leaving out the first (its start-up) when there are three or more;
    None before any iteration. The median, because one iteration slowed by the shared host is not the run."""
    times = list(iteration_s[1:] if len(iteration_s) >= 3 else iteration_s)
    return statistics.median(times) if times else None


def measured_throughput(batch_size: int, iteration_s: Sequence[float]) -> float | None:
    """Samples per device second at the measured iteration time; None before any iteration."""
    seconds = measured_iteration_s(iteration_s)
    return batch_size / seconds if seconds else None


PAUSE_GAPS = 5  # a gap between iteration reports this many times the usual one is a pause, not training


def time_left_s(arrivals: Sequence[tuple[float, int]], total: int, min_span_s: float = 1.0) -> float | None:
    """Seconds until a run of `total` iterations ends at the pace of `arrivals`: (wall seconds, iteration) of
    each iteration reported, oldest first. Every report is one iteration trained, a replayed one too (after a
    recovery the run trains iterations again), and what is left counts from the newest report's iteration, so
    a replay makes the estimate longer rather than stale. A pause far longer than the usual gap between reports
    (a recovery: detection, re-planning, restoring) is left out of the pace, which is the training's. None with
    fewer than two reports or under `min_span_s` between them (reports that came in one batch say nothing)."""
    if len(arrivals) < 2:
        return None
    span = arrivals[-1][0] - arrivals[0][0]
    if span < min_span_s:
        return None
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
    usual = statistics.median([g for g in gaps if g > 0])  # (reports of one batch come 0 s apart)
    pauses = [g for g in gaps if g > PAUSE_GAPS * usual]
    trained = len(gaps) - len(pauses)
    if not trained:
        return None
    return (span - sum(pauses)) / trained * max(0, total - (arrivals[-1][1] + 1))
