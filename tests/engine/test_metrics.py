"""How a run's pace is measured: the time left of a run from its iteration reports (engine/metrics.py)."""

import pytest

from engine.metrics import time_left_s


def reports(numbers, every=2.0, start=0.0, pause_after=None, pause=0.0):
    out, t = [], start
    for k, n in enumerate(numbers):
        out.append((t, n))
        t += every + (pause if pause_after is not None and k == pause_after else 0.0)
    return out


def test_the_time_left_counts_replays_as_work_and_leaves_a_recoverys_pause_out_of_the_pace():
    assert time_left_s(reports(range(10)), 40) == pytest.approx(2.0 * 30)
    assert time_left_s(reports([*range(12), 8, 9, 10]), 40) == pytest.approx(2.0 * 29)  # replaying 8, 9, 10
    # found trying it: after a 60 s recovery the estimate jumped to about twice the truth for the next reports
    paused = reports([*range(12), 8, 9, 10], pause_after=11, pause=60.0)
    assert time_left_s(paused, 40) == pytest.approx(2.0 * 29)


def test_reports_of_one_batch_say_nothing_of_the_pace():
    assert time_left_s([(5.0, k) for k in range(8)], 40) is None
    assert time_left_s([(5.0, 0)], 40) is None
    batches = [(float(t), 5 * t + k) for t in range(4) for k in range(5)]  # five reports a second, in batches
    assert time_left_s(batches, 100) == pytest.approx(3 / 19 * 80)
