"""The schedules: 1F1B's documented table and invariants, the zero-bubble lists' order, memory cap and
deadlock freedom, and the action string form."""

import re

import numpy as np
import pytest

from engine import schedule
from engine.schedule import Action, held, in_flight, one_f_one_b, zero_bubble

# The table in engine/schedule.py's docstring, written out: S=3, M=4.
TABLE_3_4 = {
    0: "F0 F1 F2 B0 F3 B1 B2 B3",
    1: "F0 F1 B0 F2 B1 F3 B2 B3",
    2: "F0 B0 F1 B1 F2 B2 F3 B3",
}

GRID = [(s, m) for s in range(1, 7) for m in range(1, 10)]


def test_docstring_table_for_three_stages_four_micro_batches():
    sched = one_f_one_b(3, 4)
    assert sorted(sched) == [0, 1, 2]
    for s, row in TABLE_3_4.items():
        assert [str(a) for a in sched[s]] == [f"{s}{x}" for x in row.split()]
        assert [f"{a.kind}{a.micro_batch}" for a in sched[s]] == row.split()
        assert all(a.stage == s for a in sched[s])


def test_docstring_still_shows_the_same_table():
    # The docstring is the documentation of the schedule: keep it in step with the code.
    rows = dict(re.findall(r"stage (\d+):\s+([FB0-9 ]+)\n", schedule.__doc__))
    assert {int(k): " ".join(v.split()) for k, v in rows.items()} == TABLE_3_4


@pytest.mark.parametrize("S,M", GRID)
def test_every_stage_runs_each_forward_and_backward_once_forward_first(S, M):
    sched = one_f_one_b(S, M)
    assert sorted(sched) == list(range(S))
    for s, acts in sched.items():
        assert all(a.stage == s and a.kind in ("F", "B") for a in acts)
        fwd = [a.micro_batch for a in acts if a.kind == "F"]
        bwd = [a.micro_batch for a in acts if a.kind == "B"]
        assert fwd == list(range(M)) and bwd == list(range(M))  # each once, in micro-batch order
        pos = {(a.kind, a.micro_batch): k for k, a in enumerate(acts)}
        assert all(pos[("F", k)] < pos[("B", k)] for k in range(M))
        # 1F1B: warm-up forwards, then strict alternation, then the drain.
        warm = min(S - s - 1, M)
        assert [a.kind for a in acts[:warm]] == ["F"] * warm
        steady = acts[warm : warm + 2 * (M - warm)]
        assert [a.kind for a in steady] == ["F", "B"] * (M - warm)
        assert [a.kind for a in acts[warm + 2 * (M - warm) :]] == ["B"] * warm


@pytest.mark.parametrize("S,M", GRID)
def test_most_micro_batches_held_at_once_is_in_flight(S, M):
    # The memory model charges stage s for in_flight(S, M, s) micro-batches of activations: exactly the
    # most forwards whose backward has not run yet at any point of the stage's list.
    for s, acts in one_f_one_b(S, M).items():
        held = peak = 0
        for a in acts:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        assert held == 0
        assert peak == in_flight(S, M, s) == min(S - s, M)


def test_last_stage_alternates_and_first_stage_warms_up_fully():
    sched = one_f_one_b(4, 6)
    assert [str(a) for a in sched[3]] == [f"3{k}{m}" for m in range(6) for k in "FB"]
    assert [str(a) for a in sched[0][:4]] == ["0F0", "0F1", "0F2", "0F3"]


@pytest.mark.parametrize("S,M", [(0, 1), (1, 0), (-1, 3)])
def test_rejects_empty_pipelines(S, M):
    with pytest.raises(ValueError):
        one_f_one_b(S, M)


@pytest.mark.parametrize("S,M", [(1, 1), (3, 4), (12, 11), (2, 15)])
def test_action_string_round_trip(S, M):
    for acts in one_f_one_b(S, M).values():
        for a in acts:
            assert Action.parse(str(a)) == a


def test_action_string_form():
    assert str(Action(2, "F", 0)) == "2F0"
    assert str(Action(10, "B", 13)) == "10B13"
    assert Action.parse("10B13") == Action(10, "B", 13)
    assert Action.parse("0F7") == (0, "F", 7)


@pytest.mark.parametrize("text", ["", "2X0", "F", "abc"])
def test_action_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Action.parse(text)


# -- zero-bubble schedules -------------------------------------------------------------------------------


def random_times(rng, S):
    """Unequal stages, as Asteroid plans them: the first stage's whole backward is W."""
    times = []
    for s in range(S):
        f, b, w = (rng.uniform(0.2, 3.0) for _ in range(3))
        times.append(schedule.StageTimes(f, 0.0 if s == 0 else b, w + (b if s == 0 else 0.0), *rng.uniform(0, 1, 2)))
    return times


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_lists_run_each_step_once_in_order_within_the_memory_cap(name):
    rng = np.random.default_rng(7)
    for S, M in [(1, 1), (1, 4), (2, 1), (3, 4), (4, 8), (5, 3), (6, 16), (8, 24)]:
        lists = zero_bubble(random_times(rng, S), M, name)
        assert sorted(lists) == list(range(S))
        for s, acts in lists.items():
            assert all(a.stage == s for a in acts)
            for kind in "FBW":  # each step of each micro-batch once, in micro-batch order
                assert [a.micro_batch for a in acts if a.kind == kind] == list(range(M))
            pos = {(a.kind, a.micro_batch): k for k, a in enumerate(acts)}
            assert all(pos["F", m] < pos["B", m] < pos["W", m] for m in range(M))
            assert held(acts) <= in_flight(S, M, s, name)
            if name == "zb-h1":  # 1F1B's memory
                assert held(acts) <= min(S - s, M)


def test_zero_bubble_lists_cannot_deadlock_a_pipeline():
    # Replay the lists as the runtime runs them (each stage in its own order, each step waiting for its input or
    # gradient): every stage finishes. A cycle of waits would leave some list unfinished.
    rng = np.random.default_rng(11)
    for name in ("zb-h1", "zb-h2"):
        for S, M in [(2, 3), (4, 8), (7, 5), (8, 32)]:
            lists = zero_bubble(random_times(rng, S), M, name)
            pos, done = dict.fromkeys(range(S), 0), set()
            moved = True
            while moved:
                moved = False
                for s, acts in lists.items():
                    while pos[s] < len(acts):
                        a = acts[pos[s]]
                        need = {"F": (s - 1, "F"), "B": (s + 1, "B"), "W": (s, "B")}[a.kind]
                        if 0 <= need[0] < S and (need[0], need[1], a.micro_batch) not in done:
                            break
                        if a.kind == "B" and s == S - 1 and (s, "F", a.micro_batch) not in done:
                            break
                        done.add((s, a.kind, a.micro_batch))
                        pos[s] += 1
                        moved = True
            assert all(pos[s] == 3 * M for s in range(S)), (name, S, M)


def test_zero_bubble_rejects_bad_arguments():
    t = [schedule.StageTimes(1, 1, 1, 0, 0)]
    for bad in [([], 4, "zb-h1"), (t, 0, "zb-h1"), (t, 4, "1f1b"), (t, 4, "zb-v")]:
        with pytest.raises(ValueError):
            zero_bubble(*bad)


def test_held_counts_until_w_where_the_list_has_one():
    assert held(one_f_one_b(4, 8)[0]) == 4
    assert held([Action(0, k, m) for k, m in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("W", 0)]]) == 3


@pytest.mark.parametrize("S, M", [(1, 1), (2, 5), (4, 8), (7, 3), (9, 64)])
def test_the_simulators_arrays_are_the_runtimes_lists(S, M):
    # the simulator reads the compiled arrays, a device's process the lists: both must be the same schedule
    assert schedule.actions(*schedule.codes(S, M, "1f1b")) == one_f_one_b(S, M)
    times = random_times(np.random.default_rng(S * M), S)
    for name in ("zb-h1", "zb-h2"):
        assert schedule.actions(*schedule.codes(S, M, name, times)) == zero_bubble(times, M, name)
