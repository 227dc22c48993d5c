"""Splitting a stage's micro-batch over its devices: each device's time u(n) = fixed + n * per_sample for n
samples, capped by its memory, and the split that minimises the slowest (a water fill, exact)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StageTerms:
    """u(n) = fixed + n * per_sample for one device on one stage, and its sample cap from memory."""

    fixed: float
    per_sample: float
    cap: int  # most samples per micro-batch that fit in the device's memory (0: not even one)


def allocate(terms: list[StageTerms], counts: list[int], m: int) -> tuple[float, list[list[int]]] | None:
    """Split m samples over classes of identical devices (counts[k] devices with terms[k]) minimizing the
    slowest device's time, every device >= 1 sample and within its memory cap. Exact.

    Returns (stage time, per-class list of per-device samples), or None when it cannot fit.
    Starts from the proportional (fractional) split, which never overshoots the optimum, then moves
    single samples greedily to the device that finishes earliest with one more (or off the straggler).
    """
    g = sum(counts)
    if g == 0 or g > m:
        return None
    if any(c and t.cap < 1 for t, c in zip(terms, counts)):
        return None
    if sum(min(t.cap, m) * c for t, c in zip(terms, counts)) < m:
        return None
    base, extra = [0] * len(counts), [0] * len(counts)
    fixed, per, cap = [t.fixed for t in terms], [t.per_sample for t in terms], [t.cap for t in terms]
    time = water_fill(fixed, per, cap, counts, m, base, extra)
    shares = [[base[k] + 1] * extra[k] + [base[k]] * (c - extra[k]) for k, c in enumerate(counts)]
    return time, shares


def water_fill(fixed, per, cap, counts, m: int, base, extra) -> float:
    """`allocate`'s split over per-class sequences (class k: counts[k] devices taking fixed[k] + n * per[k] seconds
    for n samples, at most cap[k]), once it is known to fit; the compiled search runs this same function
    (engine.planners.stagecosts). Fills `base` and `extra` (zeros) in place: extra[k] devices of class k hold
    base[k] + 1 samples, the rest base[k]. Returns the stage time. (numba's on-disk cache of the compiled search
    does not notice an edit here: remove engine/planners/__pycache__/*.nb? after one.)"""
    K = len(counts)
    # Fractional water level ignoring caps: sum_k c_k (T - o_k) / p_k = m.
    inv = 0.0
    lifted = 0.0
    for k in range(K):
        if counts[k]:
            inv += counts[k] / per[k]
    for k in range(K):
        if counts[k]:
            lifted += counts[k] * fixed[k] / per[k]
    level = (m + lifted) / inv
    total = 0
    for k in range(K):
        if counts[k]:
            q = math.floor((level - fixed[k]) / per[k])
            base[k] = max(1, min(cap[k], q))
            total += base[k] * counts[k]
    while total > m:  # only from the >= 1 clamp: take samples off the slowest device
        pick, worst = -1, -math.inf
        for k in range(K):
            if counts[k] and (base[k] > 1 or extra[k]):
                f = fixed[k] + (base[k] + (1 if extra[k] else 0)) * per[k]
                if pick < 0 or f > worst:
                    pick, worst = k, f
        if extra[pick]:
            extra[pick] -= 1
        else:
            base[pick] -= 1
            extra[pick] = counts[pick] - 1
        total -= 1
    while total < m:  # one sample at a time to the device that finishes earliest with it
        pick, best_t = -1, math.inf
        for k in range(K):
            if not counts[k]:
                continue
            nxt = base[k] + 1
            if nxt > cap[k]:
                continue
            t_next = fixed[k] + nxt * per[k]
            if t_next < best_t:
                pick, best_t = k, t_next
        extra[pick] += 1
        if extra[pick] == counts[pick]:
            base[pick] += 1
            extra[pick] = 0
        total += 1
    time = -math.inf
    for k in range(K):
        if counts[k]:
            f = fixed[k] + (base[k] + (1 if extra[k] else 0)) * per[k]
            if f > time:
                time = f
    return time


def stage_time(terms: list[StageTerms], shares: list[int]) -> float:
    return max(t.fixed + n * t.per_sample for t, n in zip(terms, shares))
