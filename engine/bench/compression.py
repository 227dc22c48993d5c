"""`python -m engine bench compression`: real training on emulated clusters at each compression level against none.

Per cell (model and its dataset, cluster, bandwidth) and level (off, 8, 4, 2, auto; delta:4 and delta:2 send changes
of activations, engine.deltas, and keep up to the training set's samples per pair) the Asteroid planner plans at
that level (compression changes what is worth sending, so the plan may change shape) and the plan is trained twice
from the same seed: a short emulated run (time dilation) measures throughput in device time, bytes on the wire and
late steps; a longer run at host speed (no padding: the same arithmetic, bit for bit, only faster) trains the same
number of samples at every level and scores the held-out split after its last iteration: accuracy for
classification, loss for language models. A compressed plan is also trained uncompressed with the same shape: the
plan's shape alone changes training a little (batch norm sees each device's slice), so the loss that compression
itself costs is the difference between those two.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.bench.records import read_records, write_record

# Each model with the real dataset it learns, its learning rate and the iterations of its accuracy run.
MODELS = {"mobilenetv2": ("digits", 0.02, 60), "gpt-small": ("pytext", 0.01, 20)}
LEVELS = ("off", "8", "4", "2", "auto", "delta:4", "delta:2")  # delta: changes of activations (engine.deltas)
BATCH = 64
TIMING_ITERATIONS = 6  # of the emulated run; the first is left out of the measured throughput (metrics)
EVAL_SAMPLES = 320


@dataclass
class Run:
    model: str
    dataset: str
    cluster: str
    bandwidth_mbps: float
    level: str  # off, 8, 4, 2, auto, delta:4 or delta:2
    iterations: int
    batch_size: int
    shape: str = ""  # the plan: stages and devices
    compression: str = ""  # the plan's level per boundary
    predicted: float = 0.0  # samples/s: the plan's simulated throughput (the closed form's where not simulated)
    throughput: float = 0.0  # measured samples/s, device time
    wire_bytes: int = 0  # per iteration, between stages
    payload_bytes: int = 0
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    same_plan_loss: float | None = None  # the same plan trained uncompressed (compressed levels only)
    same_plan_accuracy: float | None = None
    eval_samples: int = 0
    late: str = ""
    wall_s: float = 0.0
    error: str = ""
    same_as: str = ""  # the level whose identical plan was trained (its measurements are shown again)


def run_one(
    model: str, letter: str, mbps: float, level: str, iterations: int | None, batch: int, seen: dict | None = None
) -> Run:
    """Plan at `level`, time it emulated, train it at host speed and score it; a failure is recorded, not raised.
    `seen` maps plans already run in this cell to their runs: a level whose plan is one of them (auto often picks
    a fixed level's plan) takes that run's measurements instead of training the same plan again."""
    from engine.compression import parse_compression
    from engine.data import train_size
    from engine.devices import load_cluster
    from engine.errors import UserError
    from engine.models import get_model
    from engine.planners import NoFeasiblePlan, Problem
    from engine.planners.levels import plan_compressed
    from engine.runtime.launcher import RunOptions, train
    from engine.tables import shape
    from engine.workloads import workload

    dataset, lr, default_iterations = MODELS[model]
    iterations = iterations or default_iterations
    run = Run(model, dataset, letter, mbps, level, iterations, batch)
    started = time.monotonic()
    try:
        w = workload(model)
        problem = Problem(w, load_cluster(letter, mbps), batch)
        asked = parse_compression(level)
        samples = train_size(dataset, get_model(model)) if asked.delta else None
        plan = plan_compressed("asteroid", problem, *asked, samples=samples)
        run.shape = shape(plan)
        run.compression = ",".join("off" if b >= 32 else str(b) for b in plan.compression) or "off"
        run.predicted = plan.predicted.expected_throughput
        key = json.dumps(plan.to_dict(), sort_keys=True)
        if seen is not None and key in seen:
            return replace(seen[key], level=level, wall_s=0.0, same_as=seen[key].level)
        timing = RunOptions(iterations=TIMING_ITERATIONS, lr=lr, dataset=dataset, emulate=True)
        learning = RunOptions(
            iterations=iterations, lr=lr, dataset=dataset, emulate=False, eval_every=iterations,
            eval_samples=EVAL_SAMPLES,
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as run_dir:
            timed = train(plan, w, timing, run_dir=run_dir, replicate_every=0)
            learned = train(plan, w, learning, run_dir=run_dir, replicate_every=0)
            if plan.compressed:
                plain = train(plan.with_compression(()), w, learning, run_dir=run_dir, replicate_every=0)
                run.same_plan_loss, run.same_plan_accuracy = plain.evals[-1]["loss"], plain.evals[-1]["accuracy"]
        if seen is not None:
            seen[key] = run
        run.throughput = timed.throughput
        run.wire_bytes = timed.wire_bytes // TIMING_ITERATIONS
        run.payload_bytes = timed.payload_bytes // TIMING_ITERATIONS
        run.late = f"{timed.late_steps}/{timed.steps}"
        last = learned.evals[-1]
        run.eval_loss, run.eval_accuracy, run.eval_samples = last["loss"], last["accuracy"], last["samples"]
    except (UserError, NoFeasiblePlan, RuntimeError) as exc:
        run.error = str(exc).splitlines()[0][:200]
    run.wall_s = time.monotonic() - started
    return run


def compression_bench(
    models: tuple[str, ...],
    clusters: str,
    bandwidths: tuple[float, ...],
    levels: tuple[str, ...],
    iterations: int | None,
    batch: int,
    record: Path | None = None,
) -> list[Run]:
    """Every cell and level, in order; each finished run is written to `record` at once (a long bench that is
    stopped keeps what it measured)."""
    runs: list[Run] = []
    total = len(models) * len(clusters) * len(bandwidths) * len(levels)
    for model in models:
        for letter in clusters:
            for mbps in bandwidths:
                seen: dict = {}
                for level in levels:
                    print(
                        f"[{len(runs) + 1}/{total}] {model} on {letter} at {mbps:g} Mbps, compression {level}",
                        file=sys.stderr,
                        flush=True,
                    )
                    runs.append(run_one(model, letter, mbps, level, iterations, batch, seen))
                    write_record(record, runs)
    return runs


def load_runs(paths: list[Path]) -> list[Run]:
    """Runs from `--record` files; a later run of the same cell and level replaces an earlier one."""
    return read_records(paths, Run, lambda r: (r.model, r.cluster, r.bandwidth_mbps, r.level), "compression")


def _held_out(r: Run) -> str:
    if r.eval_accuracy is not None:
        return f"{r.eval_accuracy:.1%}"
    return f"{r.eval_loss:.3f}" if r.eval_loss is not None else "-"


def _cost(r: Run) -> str:
    """What compression itself cost the held-out score: against the same plan uncompressed."""
    if r.eval_accuracy is not None and r.same_plan_accuracy is not None:
        return f"{(r.eval_accuracy - r.same_plan_accuracy) * 100:+.1f} points"
    if r.eval_loss is not None and r.same_plan_loss is not None:
        return f"{r.eval_loss - r.same_plan_loss:+.3f}"
    return "-"


def report(runs: list[Run], command: str) -> str:
    """Markdown: one table per cell, every level against off."""
    lines = [
        f"`{command}`: global batch {runs[0].batch_size if runs else BATCH}; throughput (device time), bytes and late "
        f"steps from {TIMING_ITERATIONS} emulated iterations; held-out score after the accuracy run's iterations "
        "(the same samples at every level, from the same seed).",
        "",
    ]
    cells: dict[tuple, list[Run]] = {}
    for r in runs:
        cells.setdefault((r.model, r.dataset, r.cluster, r.bandwidth_mbps), []).append(r)
    best: tuple[float, str] = (0.0, "")
    for (model, dataset, letter, mbps), cell in cells.items():
        off = next((r for r in cell if r.level == "off" and not r.error), None)
        metric = "held-out accuracy" if any(r.eval_accuracy is not None for r in cell) else "held-out loss"
        lines += [
            f"**{model} on {dataset}, cluster {letter}, {mbps:g} Mbps** ({cell[0].iterations} iterations of "
            f"{cell[0].batch_size} for the held-out score)",
            "",
            f"| compression | plan | boundaries | predicted samples/s | measured samples/s | vs off | MB sent per "
            f"iteration | fewer bytes | {metric} | vs the same plan uncompressed | late steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in cell:
            if r.error:
                lines.append(f"| {r.level} | {r.shape or '-'} | {r.compression or '-'} | - | failed: {r.error} ||||||")
                continue
            gain = r.throughput / off.throughput if off else None
            if gain and r.compression != "off" and gain > best[0]:
                best = (gain, f"{model} on {letter} at {mbps:g} Mbps, {r.level}")
            fewer = f"{r.payload_bytes / r.wire_bytes:.1f}x" if r.wire_bytes else "-"
            level = f"{r.level} (= {r.same_as})" if r.same_as else r.level
            lines.append(
                f"| {level} | {r.shape} | {r.compression} | {r.predicted:.1f} | {r.throughput:.1f} | "
                f"{f'{gain:.2f}x' if gain else '-'} | {r.wire_bytes / 1e6:.2f} | {fewer} | {_held_out(r)} | "
                f"{_cost(r)} | {r.late} |"
            )
        lines.append("")
    if best[1]:
        lines.append(f"Largest measured gain of compression over none: {best[0]:.2f}x ({best[1]}).")
    walls = [r.wall_s for r in runs]
    if walls:
        lines.append(
            f"{len(runs)} runs, {sum(walls) / 60:.1f} min wall in all (median {statistics.median(walls):.0f} s)."
        )
    return "\n".join(lines)


def figure(runs: list[Run], prefix: Path) -> list[Path]:
    """Measured throughput (bars) and held-out score (markers) per level, one panel per cell: HTML and PNG."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cells: dict[tuple, list[Run]] = {}
    for r in runs:
        cells.setdefault((r.model, r.cluster, r.bandwidth_mbps), []).append(r)
    keys = list(cells)
    fig = make_subplots(
        rows=1,
        cols=len(keys),
        subplot_titles=[f"{m} / {c} / {b:g} Mbps" for m, c, b in keys],
        specs=[[{"secondary_y": True}] * len(keys)],
    )
    for col, k in enumerate(keys, start=1):
        ok = [r for r in cells[k] if not r.error]
        x = [r.level for r in ok]
        fig.add_trace(
            go.Bar(x=x, y=[r.throughput for r in ok], name="samples/s", marker_color="#1f77b4", showlegend=col == 1),
            row=1,
            col=col,
        )
        score = [r.eval_accuracy * 100 if r.eval_accuracy is not None else r.eval_loss for r in ok]
        label = "held-out accuracy %" if ok and ok[0].eval_accuracy is not None else "held-out loss"
        fig.add_trace(
            go.Scatter(x=x, y=score, name=label, mode="markers+lines", marker_color="#d62728", showlegend=True),
            row=1,
            col=col,
            secondary_y=True,
        )
    fig.update_layout(
        title="Compression between stages: measured throughput and held-out score after the same samples",
        width=380 * max(len(keys), 2),
        height=480,
    )
    from engine.bench.render import write_figure

    return write_figure(fig, prefix)
