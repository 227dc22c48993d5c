"""This host's monotonic clock against the site's, NTP-style: offset and drift fitted to the lowest-delay probes."""

from __future__ import annotations

import math
from collections import deque

WINDOW = 64  # probes kept (at one every 5 s, about five minutes)
READY_AFTER = 4  # probes before the estimate is used
BEST_FRACTION = 4  # the estimate rests on the lowest-delay quarter of the window (NTP's clock filter)
MIN_SPAN_S = 20.0  # the best probes must span this much local time before a drift is fitted
MAX_DRIFT_PPM = 500.0  # a crystal is off by tens of ppm: a steeper fit is noise
TOLERANCE_S = 1e-6  # a delay this far below zero is rounding, not a malformed probe
STEP_S = 1.0  # a probe this far outside the estimate (beyond its own bound) means the site's clock stepped


class ClockSync:
    """The offset of the site's clock from this host's: `site_time = local_time + offset(local_time)`.

    `add` is called from one thread (the agent's loop); every reader sees one consistent estimate from any thread.
    """

    def __init__(self, window: int = WINDOW, ready_after: int = READY_AFTER):
        self._probes: deque[tuple[float, float, float]] = deque(maxlen=window)  # (local time, theta, delay)
        self._ready_after = ready_after
        self._estimate = {"offset_s": 0.0, "drift_ppm": 0.0, "ref_s": 0.0, "error_s": None, "samples": 0}

    def add(self, t0: float, t1: float, t2: float, t3: float) -> bool:
        """One probe: t0 sent and t3 answered (this host's clock), t1 received and t2 answered (the site's).
        False (and nothing kept) for a malformed one."""
        if not all(_finite(t) for t in (t0, t1, t2, t3)):
            return False
        delay = (t3 - t0) - (t2 - t1)
        if t3 < t0 or t2 < t1 or delay < -TOLERANCE_S:
            return False
        at, theta, delay = (t0 + t3) / 2, ((t1 - t0) + (t2 - t3)) / 2, max(delay, 0.0)
        if self.ready and abs(theta - self.offset(at)) > delay / 2 + self.error_s + STEP_S:
            self._probes.clear()  # the site's host rebooted (or this one's clock jumped): start over
        self._probes.append((at, theta, delay))
        self._estimate = _fit(list(self._probes))
        return True

    @property
    def ready(self) -> bool:
        return self._estimate["samples"] >= self._ready_after

    @property
    def samples(self) -> int:
        return self._estimate["samples"]

    @property
    def error_s(self) -> float:
        """The bound on the offset's error at `ref_s` (inf before any probe): half the round trip's delay of the
        best probe, or half the mean delay of the probes a drift was fitted to (the line passes through their mean)."""
        error = self._estimate["error_s"]
        return math.inf if error is None else error

    @property
    def drift_ppm(self) -> float:
        """How much faster the site's clock runs than this one's, in parts per million."""
        return self._estimate["drift_ppm"]

    def offset(self, at: float | None = None) -> float:
        """The site's clock minus this one's at local time `at` (None: at the estimate's anchor, `ref_s`)."""
        estimate = self._estimate
        if at is None:
            return estimate["offset_s"]
        return estimate["offset_s"] + estimate["drift_ppm"] * 1e-6 * (at - estimate["ref_s"])

    def to_site(self, local_t: float) -> float:
        """A time of this host's monotonic clock in the site's."""
        return site_time(self._estimate, local_t)

    def to_dict(self) -> dict:
        """The estimate as plain data, for device processes: offset_s at ref_s, drift_ppm, error_s, samples."""
        return dict(self._estimate)


def site_time(estimate: dict | None, local_t: float) -> float:
    """`local_t` (this host's monotonic clock) in the site's, by a `ClockSync.to_dict()`; unchanged without one."""
    if not estimate:
        return local_t
    return local_t + estimate["offset_s"] + estimate["drift_ppm"] * 1e-6 * (local_t - estimate["ref_s"])


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _fit(probes: list[tuple[float, float, float]]) -> dict:
    """Offset and drift from the lowest-delay probes: a least-squares line once they span MIN_SPAN_S, else the
    best probe's offset."""
    best = sorted(probes, key=lambda p: p[2])[: max(1, len(probes) // BEST_FRACTION)]
    times = [p[0] for p in best]
    if max(times) - min(times) < MIN_SPAN_S:
        at, theta, delay = best[0]
        return {"offset_s": theta, "drift_ppm": 0.0, "ref_s": at, "error_s": delay / 2, "samples": len(probes)}
    ref = sum(times) / len(best)
    offset = sum(p[1] for p in best) / len(best)
    slope = sum((t - ref) * (theta - offset) for t, theta, _ in best) / sum((t - ref) ** 2 for t in times)
    drift = max(-MAX_DRIFT_PPM, min(MAX_DRIFT_PPM, slope * 1e6))
    error = sum(p[2] for p in best) / len(best) / 2
    return {"offset_s": offset, "drift_ppm": drift, "ref_s": ref, "error_s": error, "samples": len(probes)}
