"""ClockSync on synthetic clocks: an offset of days, a drift, asymmetric and huge delays, malformed probes."""

import json
import math
import random

import pytest

from workers.clock import ClockSync, site_time

DAYS = 3 * 86400 + 12.3  # the site's host booted three days before this board


class Link:
    """A board whose clock reads `local`, a site whose clock reads `local + offset + drift * local`, and random
    delays each way (asymmetric: the two directions are drawn independently)."""

    def __init__(self, offset: float, drift_ppm: float = 0.0, seed: int = 0):
        self.offset, self.drift, self.rng = offset, drift_ppm * 1e-6, random.Random(seed)

    def true_offset(self, local: float) -> float:
        return self.offset + self.drift * local

    def delay(self) -> float:
        return 0.0002 + self.rng.expovariate(1 / 0.001)  # a LAN: 0.2 ms at best, 1 ms more on average

    def probe(self, t0: float, out: float | None = None, back: float | None = None) -> tuple[float, ...]:
        out = self.delay() if out is None else out
        back = self.delay() if back is None else back
        t1 = t0 + out + self.true_offset(t0 + out)
        t2 = t1 + 0.0002  # the site answers at once
        return t0, t1, t2, t0 + out + 0.0002 + back


def burst(clock: ClockSync, link: Link, start: float, count: int = 8, every: float = 0.05) -> None:
    for k in range(count):
        assert clock.add(*link.probe(start + k * every))


def test_an_offset_of_days_is_recovered_within_the_min_delay_bound():
    link, clock = Link(DAYS, seed=1), ClockSync()
    assert not clock.ready and clock.samples == 0 and clock.error_s == math.inf
    burst(clock, link, 5000.0, count=3)
    assert not clock.ready
    burst(clock, link, 5000.15, count=5)
    assert clock.ready and clock.samples == 8 and clock.drift_ppm == 0.0  # 0.35 s: too short for a drift
    assert abs(clock.offset(5000.2) - DAYS) <= clock.error_s < 0.003
    assert abs(clock.to_site(5000.2) - (5000.2 + DAYS)) <= clock.error_s
    for k in range(60):  # then one every 5 s: a line through the best quarter, still within its bound
        assert clock.add(*link.probe(5001.0 + 5 * k))
    assert clock.samples == 64 and abs(clock.drift_ppm) < 5
    assert abs(clock.offset() - DAYS) <= clock.error_s < 0.003


@pytest.mark.parametrize("seed", range(5))
def test_a_drift_of_50_ppm_is_recovered_over_200_s(seed):
    link, clock = Link(-DAYS, drift_ppm=50.0, seed=seed), ClockSync()
    for k in range(41):
        clock.add(*link.probe(1000.0 + 5 * k))
    assert abs(clock.drift_ppm - 50.0) < 5, clock.to_dict()
    estimate = clock.to_dict()
    assert abs(clock.offset(estimate["ref_s"]) - link.true_offset(estimate["ref_s"])) <= clock.error_s
    assert abs(clock.to_site(1300.0) - (1300.0 + link.true_offset(1300.0))) < 0.005  # 100 s ahead


def test_outliers_are_ignored():
    link, clock = Link(DAYS, seed=2), ClockSync()
    for k in range(64):
        if k % 4:  # three in four stuck 2 s in one direction: their offsets are a whole second off
            clock.add(*link.probe(1000.0 + 5 * k, out=2.0 if k % 2 else 0.001, back=0.001 if k % 2 else 2.0))
        else:
            clock.add(*link.probe(1000.0 + 5 * k))
    assert clock.samples == 64 and clock.error_s < 0.005
    assert abs(clock.offset() - DAYS) <= clock.error_s and abs(clock.drift_ppm) < 10


def test_malformed_probes_are_dropped():
    clock = ClockSync()
    for probe in [
        (10.0, 20.0, 20.1, 9.0),  # answered before it was sent
        (10.0, 20.0, 19.9, 10.5),  # the site answered before it received
        (10.0, 20.0, 21.0, 10.5),  # the site took longer than the round trip: a negative delay
        (math.nan, 20.0, 20.1, 10.5),
        (10.0, math.inf, 20.1, 10.5),
        (10.0, 20.0, 20.1, True),
        (10.0, "20", 20.1, 10.5),
    ]:
        assert not clock.add(*probe), probe
    assert clock.samples == 0 and not clock.ready and clock.offset() == 0.0 and clock.to_site(5.0) == 5.0
    assert clock.add(10.0, 20.0, 20.1, 10.1 - 1e-9)  # a delay below zero by rounding only: kept


def test_a_stepped_site_clock_starts_the_estimate_over():
    link, clock = Link(DAYS, seed=3), ClockSync()
    burst(clock, link, 100.0)
    link.offset = 12.0  # the site's host rebooted
    burst(clock, link, 200.0, count=4)
    assert clock.samples == 4 and abs(clock.offset() - 12.0) <= clock.error_s


def test_the_dict_round_trips_through_json_and_site_time():
    link, clock = Link(DAYS, drift_ppm=-20.0, seed=4), ClockSync()
    assert site_time(clock.to_dict(), 7.0) == 7.0 and site_time(None, 7.0) == 7.0  # no estimate: unchanged
    for k in range(30):
        clock.add(*link.probe(1000.0 + 5 * k))
    estimate = json.loads(json.dumps(clock.to_dict()))
    assert set(estimate) == {"offset_s", "drift_ppm", "ref_s", "error_s", "samples"} and estimate["samples"] == 30
    for local in (1000.0, 1075.5, 1400.0):
        assert site_time(estimate, local) == clock.to_site(local) == local + clock.offset(local)
    assert estimate["offset_s"] == clock.offset() and estimate["drift_ppm"] == clock.drift_ppm
