"""`bench reproduce` summaries: runs are held to their simulated iteration where recorded, old records still load."""

from __future__ import annotations

import json
from dataclasses import asdict

from engine.bench.render import report
from engine.bench.reproduce import Run, claims, load_runs, summarize


def run(method: str, measured: float, predicted: float, simulated: float | None = None) -> Run:
    return Run("C", "mobilenetv2", 32, 1000.0, method, "ok", predicted, simulated, measured, [2.3, 2.2], 0, 10, 50.0)


def test_measured_runs_are_held_to_the_simulated_iteration_where_known():
    runs = [run("asteroid", 0.0102, 0.0120, 0.0100), run("ftpipehd", 0.0200, 0.0200)]
    c = claims(summarize(runs))
    assert c.wins == 1 and c.comparisons == 1
    assert c.within == [abs(0.0102 / 0.0100 - 1)]  # against the simulation, not the closed form's 0.0120
    text = report(runs, "bench reproduce")
    assert "(1.02)" in text and "(1.00)" in text  # measured / simulated; the closed-form-only run against it
    assert "| 0.0100 | 0.0120 |" in text  # the every-run table keeps both predictions
    # no DDP run: the claim says so rather than "0.00x ()"; the pipeline claim names its cell
    assert "over data parallelism (DDP): none measured (no cell ran both)" in text
    assert "best other pipeline method: 1.96x (mobilenetv2 on C at 1000 Mbps)" in text


def test_records_from_before_the_simulation_load_and_use_the_closed_form(tmp_path):
    doc = asdict(run("asteroid", 0.011, 0.010))
    del doc["simulated_s"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps([doc]))
    (loaded,) = load_runs([path])
    assert loaded.simulated_s is None and loaded.expected_s == 0.010


def test_a_rival_that_ran_asteroids_own_plan_is_a_tie_not_a_loss():
    ours = run("asteroid", 0.0101, 0.0120, 0.0100)
    same = run("ftpipehd", 0.0100, 0.0120, 0.0100)  # its planner chose the same plan, measured a little faster
    same.shape = ours.shape = "tx2 > nano, M=8"
    other = run("pipedream", 0.0300, 0.0300, 0.0280)
    c = claims(summarize([ours, same, other]))
    assert (c.wins, c.ties, c.comparisons) == (1, 1, 2)
    assert abs(c.tie_spread - (1 - 0.0100 / 0.0101)) < 1e-12
    text = report([ours, same, other], "bench reproduce")
    assert "0.99x (same plan)" in text and "won 1 and lost 0 of 2; in the other 1" in text
