"""`bench planner` pieces: timing cells run in a child process, and exact search never loses to ordered."""

from __future__ import annotations

import pytest

from engine.bench.planner import exact_vs_ordered, synthetic_cluster, synthetic_workload, time_planning, zoo_table
from engine.planners import Problem, make_plan


def test_time_planning_reports_the_plan_it_timed():
    seconds, stages, micro_batches, iteration = time_planning(4, 12, timeout=120)
    plan = make_plan("asteroid", Problem(synthetic_workload(12), synthetic_cluster(4), 256))
    assert seconds > 0
    assert (stages, micro_batches) == (len(plan.stages), plan.micro_batches)
    assert iteration == plan.predicted.iteration_s


def test_zoo_table_times_each_model_on_each_cluster(profile_cache):
    from engine.workloads import workload

    lines = zoo_table((16,), {"mobilenetv2": 128}, timeout=120)
    row = next(line for line in lines if line.startswith("| mobilenetv2"))
    plan = make_plan("asteroid", Problem(workload("mobilenetv2"), synthetic_cluster(16), 256))
    assert row.startswith(f"| mobilenetv2 ({workload('mobilenetv2').num_layers}) | ")
    assert f"({len(plan.stages)} st, M={plan.micro_batches})" in row


def test_exact_search_is_never_worse_than_the_published_space():
    lines = exact_vs_ordered((4,), (8, 12), timeout=120)
    rows = [line for line in lines if line.startswith("| 4 |")]
    assert len(rows) == 2
    for row in rows:
        gain = float(row.rstrip(" |").rsplit("|", 1)[1].strip().rstrip(" %"))
        assert gain >= 0


def test_recovery_report_keeps_real_and_device_seconds_apart():
    from engine.bench.recovery import Cell, Ours, Overhead, Restart, Result, report, victims
    from engine.devices import load_cluster
    from tests.engine.runtime.helpers import make_plan as hand_plan

    c, b = load_cluster("C", 1000), load_cluster("B", 1000)
    plan = hand_plan("m", c, 8, 1, [(0, 5, [("nx-0", 6), ("tx2-1", 2)]), (5, 9, [("nano-0", 8)])])
    assert victims(plan, "nx") == ("nx-0",) and victims(plan, "one") == ("tx2-1",)
    assert victims(plan, "stage") == ("nano-0",) and victims(plan, "two") == ("tx2-1", "nano-0")
    one_stage = hand_plan("m", c, 8, 1, [(0, 9, [("nx-0", 8)])])
    assert victims(one_stage, "stage") is None and victims(one_stage, "two") is None
    assert victims(hand_plan("m", b, 8, 1, [(0, 9, [(b.devices[0].name, 8)])]), "nx") is None
    cell = Cell("C", "mobilenetv2", 1000.0, "one", ("tx2-1",), 5, 8)
    ours = Ours(wall_s=4.0, detection_real_s=1.0, planning_real_s=0.5, setup_real_s=2.5, device_s=0.5,
                restore_device_s=0.1, replay_device_s=0.4, iterations_lost=0, throughput_before=100.0,
                throughput_after=80.0, replicate_every=2, dilation=10.0, points=[(0.4, 100.0, 0), (0.9, 80.0, 1)],
                failure_time=0.4)  # fmt: skip
    restart = Restart(checkpoint_every=2, checkpoint_iteration=4, detection_real_s=1.0, startup_real_s=11.0,
                      restore_device_s=0.2, retrain_device_s=0.8, retrained=1)  # fmt: skip
    overhead = Overhead(measured_s=0.3, predicted_s=0.25, plain_iteration_s=0.1, default_every=60)
    result = Result(cell, "ok", ours, restart, fresh_predicted=90.0, fresh_measured=82.0, overhead=overhead)
    assert abs(overhead.at_default - 0.3 / (0.3 + 6.0)) < 1e-12
    assert result.real_ratio == 3.0 and result.device_ratio == 2.0  # (1 + 11) / (1 + 0.5 + 2.5), 1.0 / 0.5
    assert restart.mid_period_device_s == 0.2 + 2 / 2 * 0.8
    assert abs(result.of_fresh - 80.0 / 82.0) < 1e-12
    text = report([result, Result(cell, "recovery failed: x")], "python -m engine bench recovery --quick")
    assert "| tx2-1 @ 5 | 4.000 (1.000 + 0.500 + 2.500) | 0.50 (0.10 + 0.40) | 4.0 | 12.00 (1.000 + 11.00) |" in text
    assert "| 3.0x | 2.0x | 1.00 | 2 | 0 |" in text
    assert "recovery failed: x" in text and "| 0.98 |" in text
    assert "| C | mobilenetv2 | 1000 | 0.300 | 0.250 | 0.100 | 60 | 4.8% |" in text


def test_spread_cluster_is_one_nx_beside_boards_ten_times_slower():
    from engine.bench.spread import SPREAD, spread_cluster

    cluster = spread_cluster(100.0)
    fast, *slow = cluster.devices
    assert fast.kind == "jetson-xavier-nx" and len(slow) == 3 and cluster.bandwidth_mbps == 100.0
    assert all(fast.gflops / d.gflops == SPREAD and d.memory_bytes == fast.memory_bytes for d in slow)


def test_spread_run_trains_the_even_pipeline_and_the_report_gives_measured_ratios():
    from engine.bench.spread import Run, report, run_one

    even = run_one("mobilenetv2", 8, 1000.0, "even", iterations=2)
    assert not even.error, even.error
    assert even.shape.count(">") == 3 and even.shape.startswith("nx-0 [0, ")  # one device per stage, in order
    assert even.measured > 0 and 0.5 < even.measured / even.predicted < 2
    ft = Run("mobilenetv2", 8, 1000.0, "ftpipehd", "x", 2, 300.0, 3 * even.measured, 900.0)
    ours = Run("mobilenetv2", 8, 1000.0, "asteroid", "y", 1, 400.0, 4 * even.measured, 900.0)
    failed = Run("vgg16", 8, 1000.0, "even", error="its best plan does not fit in memory")
    text = report([ours, ft, even, failed], "bench spread")
    assert "| mobilenetv2 | 1000 | 3.00x | 1.33x | 4.00x |" in text
    assert "failed: its best plan does not fit in memory" in text and "| vgg16 | 1000 | n/a | n/a | n/a |" in text


def test_ideal_breakdown_splits_every_devices_time():
    from engine.bench.ideal import breakdown, report
    from engine.devices import load_cluster

    cluster = load_cluster("C")
    small, large = (breakdown(synthetic_workload(20), cluster, batch) for batch in (16, 256))
    for b in (small, large):
        shares = (b.compute, b.overhead, b.allreduce, b.unused, b.waiting)
        assert all(s >= -1e-9 for s in shares) and abs(sum(shares) - 1) < 1e-9
        assert 0 < b.of_ideal < 1 and b.cluster == cluster.name and b.model == "synthetic-20"
    # A bigger batch fills the pipeline better: less of the time goes to launch overhead and waiting.
    assert large.overhead + large.waiting < small.overhead + small.waiting
    assert "| synthetic-20 | C | 256 |" in report([small, large], "bench ideal", 1000.0)


def test_ideal_bench_arguments_are_checked(capsys):
    from engine.cli import main

    for argv, message in (
        (["bench", "ideal", "--models", "gpt-small"], "--models takes some of"),
        (["bench", "ideal", "--clusters", "BX"], "--clusters takes letters of ABCD"),
        (["bench", "ideal", "--bandwidths", "100,1000"], "bench ideal takes one bandwidth"),
    ):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


# `bench reproduce --bandwidths 1000,inf` (or 1e400) trained on an infinitely fast network.
def test_bench_bandwidths_are_within_a_cluster_files_bounds():
    from engine.bench import _bandwidths
    from engine.errors import UserError

    assert _bandwidths("1000,100") == (1000.0, 100.0)
    for text in ("1000,inf", "1e400", "nan", "0", "2e6"):
        with pytest.raises(UserError, match="^--bandwidths must be a number from 0.001 to 1e\\+06, got "):
            _bandwidths(text)


def test_schedule_bench_trains_a_plan_under_each_schedule():
    from engine.bench.schedules import ScheduleRun, _run, report
    from engine.costmodel import score
    from engine.schedule import SCHEDULES
    from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

    w = model_workload("gpt-small")
    stages = [(0, 5, [("nx-0", 2)]), (5, 10, [("tx2-1", 2)]), (10, 15, [("nano-2", 2)])]
    plan = make_plan("gpt-small", cluster_of("nx", "tx2", "nano"), 8, 4, stages)
    rows = []
    for name in SCHEDULES:
        scheduled = plan.with_schedule(name)
        row = _run(scheduled.with_prediction(score(scheduled, w)), w, "chosen", 2, train_it=True)
        assert isinstance(row, ScheduleRun) and row.schedule == name
        assert row.measured_s > 0 and 0 <= row.measured_bubble < 1 and 0 < row.measured_memory < 1
        assert 0 < row.simulated_bubble < 1 and row.of_ideal > 0
        rows.append(row)
    text = report(rows, "bench schedule", 1000.0, 2)
    assert text.count("| gpt-small | test | 8 | chosen |") == 3
    assert "1.00x" in text  # 1F1B against itself


def test_measured_bubble_counts_f_b_and_w_of_one_iteration():
    from engine.bench.schedules import measured_bubble
    from engine.events import StepEvent

    events = [
        StepEvent("a", 0, 0, "F", 0.0, 1.0, iteration=3),
        StepEvent("a", 0, 0, "W", 1.0, 2.0, iteration=3),
        StepEvent("b", 1, 0, "B", 0.0, 1.0, iteration=3),
        StepEvent("b", 1, 0, "send", 1.0, 4.0, "a", iteration=3),
        StepEvent("b", 1, 0, "F", 0.0, 9.0, iteration=2),  # another iteration
    ]
    assert measured_bubble(events, ["a", "b"], 3, 4.0) == 1 - 3.0 / 8.0


def test_schedule_bench_arguments_are_checked(capsys):
    from engine.cli import main

    for argv, message in (
        (["bench", "schedule", "--models", "resnet50"], "--models takes some of"),
        (["bench", "schedule", "--clusters", "Z"], "--clusters takes letters of ABCD"),
        (["bench", "schedule", "--bandwidths", "100,1000"], "bench schedule takes one bandwidth"),
        (["bench", "schedule", "--iterations", "1"], "at least 2"),
    ):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
