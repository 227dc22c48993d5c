"""Benchmarks, kept apart from the library: `python -m engine bench planner|reproduce|recovery|compression|predictor|
spread|ideal|schedule|usermodels|gpu` (arguments in engine/cli/parser.py).

planner.py: planning time and every method's predicted throughput; reproduce.py: every method trained on emulated
clusters A-D, and its summaries as plain data; render.py: those summaries as markdown and a Plotly figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import UserError


def run(args: argparse.Namespace) -> str:
    """The markdown report of the benchmark `args.name`, from the `python -m engine bench` arguments."""
    benches = {"planner": run_planner, "reproduce": run_reproduce, "recovery": run_recovery}
    benches |= {"compression": run_compression, "predictor": run_predictor, "spread": run_spread, "ideal": run_ideal}
    benches |= {"schedule": run_schedule, "usermodels": run_usermodels, "gpu": run_gpu}
    return benches[args.name](args)


def run_gpu(args: argparse.Namespace) -> str:
    """The GPU check: its lines as they come (stderr), then the report to paste (stdout, or --output); a failed
    check is an error after the report."""
    import time

    from engine.bench.gpu import gpu_check

    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, file=sys.stderr, flush=True)

    passed = gpu_check(args.device, say)
    body = "\n".join(lines)
    report = f"Command: `{_command('gpu')}`, {time.strftime('%Y-%m-%d')} (real compute)\n\n```\n{body}\n```"
    if not passed:
        print(report)
        raise UserError(f"gpu-check failed: {lines[-1]}")
    return report


def run_planner(args: argparse.Namespace) -> str:
    from engine.bench.planner import planner_bench

    return planner_bench(quick=args.quick, timeout=args.timeout)


def run_reproduce(args: argparse.Namespace) -> str:
    """Check the reproduce arguments (each mistake is one UserError line), train or load the runs, render them."""
    from engine.bench import render, reproduce

    clusters = _clusters(args, "C" if args.quick else "ABCD")
    if args.models:
        models = {m: reproduce.MODELS.get(m, 16) for m in _zoo_models(args)}
    else:
        models = {"mobilenetv2": reproduce.MODELS["mobilenetv2"]} if args.quick else dict(reproduce.MODELS)
    bandwidths = _bandwidths(args.bandwidths)
    methods = tuple(_some_of("--methods", args.methods, reproduce.METHODS))
    command = _command("reproduce")
    if args.from_record:
        runs = reproduce.load_runs([Path(p) for p in args.from_record.split(",")])
    else:
        runs = reproduce.reproduce(
            clusters,
            models,
            bandwidths,
            methods,
            iterations=args.iterations or 2,
            budget_s=args.budget,
            progress=sys.stderr.isatty(),
            record=Path(args.record) if args.record else None,
        )
    _figure(args, render.figure, runs)
    return render.report(runs, command)


def run_recovery(args: argparse.Namespace) -> str:
    """Check the recovery arguments, run every cell (quick: cluster C, two models, 1000 Mbps, one device killed)."""
    from engine.bench import recovery

    clusters = _clusters(args, "C" if args.quick else "ABCD")
    if args.models:
        models = tuple(_zoo_models(args))
    else:
        models = recovery.QUICK_MODELS if args.quick else recovery.MODELS
    bandwidths = _bandwidths(args.bandwidths)
    iterations = args.iterations or recovery.ITERATIONS
    if iterations < 5:
        raise UserError(
            "bench recovery needs --iterations of at least 5 (a warm-up, a replication point, plain iterations, "
            "the failure, and one after it)"
        )
    fail_at = min(recovery.FAIL_AT, iterations - 1)
    scenarios = tuple(_some_of("--scenarios", args.scenarios, recovery.SCENARIOS))
    if args.quick:
        bandwidths = (1000.0,) if args.bandwidths == "1000,100" else bandwidths
        scenarios = ("one",) if not args.scenarios else scenarios
    command = _command("recovery")
    K = recovery.REPLICATE_EVERY if args.replicate_every is None else args.replicate_every
    if not 2 <= K <= fail_at - 2:
        raise UserError(
            f"--replicate-every must be 2 to {fail_at - 2}: a replication point before the failure, and plain "
            "iterations beside it to measure what it costs"
        )
    results = recovery.recovery(
        clusters, models, bandwidths, scenarios, iterations, fail_at, batch_size=args.batch_size, replicate_every=K
    )
    _figure(args, recovery.figure, results)
    return recovery.report(results, command)


def run_compression(args: argparse.Namespace) -> str:
    """Check the compression arguments, train every cell and level (quick: mobilenetv2 on C at 100 Mbps)."""
    from engine.bench import compression

    clusters = _clusters(args, "C")
    models = tuple(_models(args, compression.MODELS, compression.MODELS))
    bandwidths = _bandwidths(args.bandwidths)
    levels = compression.LEVELS
    if args.quick:
        models = ("mobilenetv2",) if not args.models else models
        bandwidths = (100.0,) if args.bandwidths == "1000,100" else bandwidths
        levels = ("off", "4")
    if args.levels:
        from engine.compression import parse_compression

        levels = tuple(x.strip().lower() for x in args.levels.split(","))
        for level in levels:
            parse_compression(level)  # a UserError names the bad one
    command = _command("compression")
    if args.from_record:
        runs = compression.load_runs([Path(p) for p in args.from_record.split(",")])
    else:
        runs = compression.compression_bench(
            models, clusters, bandwidths, levels, args.iterations, compression.BATCH,
            record=Path(args.record) if args.record else None,
        )  # fmt: skip
    _figure(args, compression.figure, runs)
    return compression.report(runs, command)


def _bandwidths(text: str) -> tuple[float, ...]:
    """`--bandwidths`: comma-separated Mbps, each within a cluster file's bounds (engine.devices.LIMITS)."""
    from engine.devices import in_limits

    try:
        bandwidths = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--bandwidths takes comma-separated numbers, got {text!r}") from None
    return tuple(in_limits("--bandwidths", "bandwidth_mbps", b) for b in bandwidths)


def run_predictor(args: argparse.Namespace) -> str:
    """Leave each measured configuration out in turn (quick: two of them, no plans) and report the errors."""
    from engine.bench import predictor
    from engine.predictor.measure import MEASUREMENTS, load

    doc = load(MEASUREMENTS)
    configs = sorted(doc["configs"])
    if args.quick:
        configs = configs[:2]
    command = _command("predictor")
    results = predictor.predictor_bench(doc, configs, plans=not args.quick, progress=sys.stderr.isatty())
    _figure(args, predictor.figure, results)
    return predictor.report(results, doc, command)


def _some_of(option: str, text: str | None, known, default=None, where: str = "") -> list[str]:
    """A comma-separated option: some of `known` (none given: `default`, or every one of `known`)."""
    names = [x.strip() for x in (text or ",".join(known if default is None else default)).split(",") if x.strip()]
    if not names or any(x not in known for x in names):
        raise UserError(f"{option} takes some of {', '.join(known)}{where}, got {text!r}")
    return names


def _models(args: argparse.Namespace, known, default) -> list[str]:
    """`--models`: comma-separated names of `known` (default: `default`)."""
    return _some_of("--models", args.models, known, default, " here")


def _zoo_models(args: argparse.Namespace) -> list[str]:
    """`--models`: comma-separated names of any model of the zoo (an unknown one: get_model's UserError)."""
    from engine.models import get_model

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in names:
        get_model(m)
    return names


def _figure(args: argparse.Namespace, figure, results) -> None:
    """`--figure PREFIX`: the benchmark's figure of `results`, and where it was written."""
    if args.figure:
        for path in figure(results, Path(args.figure)):
            print(f"figure written to {path}", file=sys.stderr)


def _clusters(args: argparse.Namespace, default: str) -> str:
    """`--clusters`: letters of ABCD (default: `default`)."""
    clusters = (default if args.clusters is None else args.clusters).upper()
    if not clusters or any(c not in "ABCD" for c in clusters):
        raise UserError(f"--clusters takes letters of ABCD, got {args.clusters!r}")
    return clusters


def _one_bandwidth(args: argparse.Namespace, name: str) -> float:
    """`--bandwidths` for a benchmark that takes one (default 1000 Mbps)."""
    bandwidths = _bandwidths(args.bandwidths if args.bandwidths != "1000,100" else "1000")
    if len(bandwidths) != 1:
        raise UserError(f"bench {name} takes one bandwidth, got {args.bandwidths!r}")
    return bandwidths[0]


def _iterations(args: argparse.Namespace, name: str, default: int) -> int:
    iterations = args.iterations or default
    if iterations < 2:
        raise UserError(f"bench {name} needs --iterations of at least 2 (the first is left out of the throughput)")
    return iterations


def _command(name: str) -> str:
    """The command line as typed, for the report."""
    return "python -m engine " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else f"bench {name}"


def run_spread(args: argparse.Namespace) -> str:
    """FTPipeHD's 10x spread, every model trained with Asteroid, FTPipeHD and the even pipeline (quick: mobilenetv2)."""
    from engine.bench import spread

    names = _models(args, spread.MODELS, spread.MODELS)
    if args.quick and not args.models:
        names = ["mobilenetv2"]
    bandwidths = _bandwidths(args.bandwidths if args.bandwidths != "1000,100" else "1000")
    iterations = _iterations(args, "spread", spread.ITERATIONS)
    runs = spread.spread_bench({m: spread.MODELS[m] for m in names}, bandwidths, iterations)
    return spread.report(runs, _command("spread"), iterations)


def run_ideal(args: argparse.Namespace) -> str:
    """Where Asteroid's device time goes against the ideal (default: the reproduction's models, B and C, 1000 Mbps)."""
    from engine.bench import ideal
    from engine.bench.reproduce import MODELS

    names, clusters, mbps = _models(args, MODELS, MODELS), _clusters(args, "BC"), _one_bandwidth(args, "ideal")
    rows = ideal.ideal_bench({m: MODELS[m] for m in names}, clusters, mbps, sys.stderr.isatty())
    return ideal.report(rows, _command("ideal"), mbps)


def run_usermodels(args: argparse.Namespace) -> str:
    """A lab's own models (default: examples/'s ResNet-18 with GroupNorm, U-Net and GPT-2 folder; --models takes
    references, FILE.py:FUNCTION@image:C,H,W or hf:DIR@text:N, at batch 32): capture, plan on A-D, train on C."""
    from engine.bench import usermodels
    from engine.models.source import reference

    if args.models:
        models = {reference(m.strip()): 32 for m in args.models.split(",") if m.strip()}
    else:
        models = usermodels.MODELS
    iterations = _iterations(args, "usermodels", usermodels.ITERATIONS)
    rows = usermodels.usermodels_bench(models, _clusters(args, "ABCD"), not args.quick, iterations)
    return usermodels.report(rows, _command("usermodels"))


def run_schedule(args: argparse.Namespace) -> str:
    """1F1B against the zero-bubble schedules, simulated and trained (default: mobilenetv2 and gpt-small on B and C
    at 1000 Mbps; --quick: simulated only)."""
    from engine.bench import schedules

    names = _models(args, schedules.MODELS, schedules.DEFAULT_MODELS)
    clusters, mbps = _clusters(args, "BC"), _one_bandwidth(args, "schedule")
    iterations = _iterations(args, "schedule", schedules.ITERATIONS)
    models = {m: schedules.MODELS[m] for m in names}
    rows = schedules.schedule_bench(models, clusters, mbps, iterations, not args.quick, sys.stderr.isatty())
    return schedules.report(rows, _command("schedule"), mbps, iterations)
