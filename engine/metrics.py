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
