"""In-stage allocation: the water fill is exact (against brute force), proportional without caps, capped by memory."""

import itertools
import math
import random

import pytest

from engine.allocation import StageTerms, allocate


def brute_force(terms: list[StageTerms], counts: list[int], m: int) -> float | None:
    """Smallest max finish time over every integer split of m (each device >= 1 and <= its cap)."""
    devices = [t for t, c in zip(terms, counts) for _ in range(c)]
    if not devices:
        return None
    best = None
    for split in itertools.product(*(range(1, min(t.cap, m) + 1) for t in devices)):
        if sum(split) != m:
            continue
        time = max(t.fixed + n * t.per_sample for t, n in zip(devices, split))
        best = time if best is None else min(best, time)
    return best


def random_allocation_case(rng: random.Random):
    k = rng.randint(1, 3)
    counts = [rng.choice([0, 1, 1, 2, 2, 3]) for _ in range(k)]
    if not any(counts):
        counts[0] = 1
    m = rng.randint(1, 9)
    terms = []
    for _ in range(k):
        cap = rng.choice([0, 1, 2, 3, 4, m, m + 3, 1 << 30])
        terms.append(StageTerms(rng.uniform(0, 0.05) * rng.choice([0, 1]), rng.uniform(1e-3, 5e-2), cap))
    return terms, counts, m


def test_allocate_matches_brute_force_on_random_cases():
    rng = random.Random(1234)
    feasible = infeasible = 0
    for case in range(200):
        terms, counts, m = random_allocation_case(rng)
        expect = brute_force(terms, counts, m)
        got = allocate(terms, counts, m)
        if expect is None:
            assert got is None, (case, terms, counts, m, got)
            infeasible += 1
            continue
        feasible += 1
        assert got is not None, (case, terms, counts, m)
        time, shares = got
        assert math.isclose(time, expect, rel_tol=1e-12), (case, terms, counts, m, time, expect)
        assert [len(s) for s in shares] == counts
        assert sum(map(sum, shares)) == m
        for t, per_class in zip(terms, shares):
            for n in per_class:
                assert 1 <= n <= t.cap
        # The reported time is the time of the reported shares.
        actual = max(t.fixed + n * t.per_sample for t, per_class in zip(terms, shares) for n in per_class)
        assert math.isclose(actual, time, rel_tol=1e-12)
    assert feasible >= 80 and infeasible >= 20  # both branches exercised


def test_allocate_proportional_to_speed_without_caps():
    fast, slow = StageTerms(0.0, 1.0, 1 << 30), StageTerms(0.0, 3.0, 1 << 30)
    time, shares = allocate([fast, slow], [1, 1], 8)
    assert shares == [[6], [2]] and time == 6.0


def test_allocate_moves_samples_off_a_capped_device():
    fast, slow = StageTerms(0.0, 1.0, 2), StageTerms(0.0, 3.0, 1 << 30)
    time, shares = allocate([fast, slow], [1, 1], 8)
    assert shares == [[2], [6]] and time == 18.0


@pytest.mark.parametrize(
    "terms,counts,m",
    [
        ([StageTerms(0, 1, 5)], [3], 2),  # more devices than samples
        ([StageTerms(0, 1, 0), StageTerms(0, 1, 9)], [1, 1], 4),  # a device that holds not even one sample
        ([StageTerms(0, 1, 2), StageTerms(0, 1, 1)], [1, 2], 5),  # caps sum to 4 < 5
        ([StageTerms(0, 1, 3)], [0], 3),  # no devices
    ],
)
def test_allocate_infeasible(terms, counts, m):
    assert allocate(terms, counts, m) is None


# ---------------------------------------------------------------- helpers
