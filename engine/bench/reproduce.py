"""`python -m engine bench reproduce`: the Asteroid paper's comparison, trained for real on emulated clusters A-D.

Every cell trains one model on one cluster at one bandwidth with each method, in one process per device,
under the same time-dilation emulation: the asteroid, pipedream and ftpipehd plans on the Asteroid
runtime, PyTorch DDP over every device, and torch.distributed.pipelining (1F1B, an even split). A run
whose estimated wall time is over the per-run budget is not trained; the report says so and shows the
cost model's prediction in its place, marked as such.

This module trains the cells and summarizes them as plain data (`summarize`, `claims`); engine/bench/render.py
writes those summaries as markdown and a figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from engine.bench.records import read_records, write_record
from engine.costmodel import ideal_throughput
from engine.devices import CLUSTERS, SHORT
from engine.errors import UserError
from engine.planners import NoFeasiblePlan, Problem, make_plan
from engine.progress import Progress

# CIFAR-size inputs; batch sizes every method fits on every cluster and a 2-core host trains in minutes.
MODELS = {"mobilenetv2": 32, "vgg16": 32, "bert-small": 8, "resnet50": 16}
BANDWIDTHS = (1000.0, 100.0)
RUNTIME_METHODS = ("asteroid", "pipedream", "ftpipehd")
METHODS = (*RUNTIME_METHODS, "ddp", "pipelining")
PIPELINES = ("pipedream", "ftpipehd", "pipelining")  # the other hybrid / pipeline methods
DEFAULT_DILATION = 60.0  # the guess for the budget until a run on the cluster measured one
STARTUP_S = 8.0  # process start, rendezvous and calibration, roughly


@dataclass
class Run:
    """One method trained in one cell (or the reason it was not)."""

    cluster: str
    model: str
    batch_size: int
    bandwidth_mbps: float
    method: str
    status: str  # ok, skipped (over the budget), oom (does not fit), failed
    predicted_s: float | None = None  # the cost model's closed form
    simulated_s: float | None = None  # the event-driven simulation of the plan (None in records before it)
    measured_s: float | None = None
    loss: list[float] = field(default_factory=list)
    late_steps: int = 0
    steps: int = 0
    dilation: float | None = None
    wall_s: float = 0.0
    shape: str = ""
    note: str = ""

    @property
    def throughput(self) -> float | None:
        return self.batch_size / self.measured_s if self.measured_s else None

    @property
    def expected_s(self) -> float | None:
        """The prediction measured runs are held to: the simulated iteration where known, else the closed form."""
        return self.simulated_s or self.predicted_s

    @property
    def predicted_throughput(self) -> float | None:
        return self.batch_size / self.expected_s if self.expected_s else None


def _shape(plan) -> str:
    """e.g. 'tx2x2 > nanox3 > nx, M=4', and the schedule where it is not 1F1B ('..., M=4, zb-h2')."""
    groups = []
    for st in plan.stages:
        kinds: dict[str, int] = {}
        for s in st.devices:
            kind = SHORT.get(plan.cluster.device(s.name).kind, "custom")
            kinds[kind] = kinds.get(kind, 0) + 1
        groups.append("+".join(f"{k}x{n}" if n > 1 else k for k, n in kinds.items()))
    return " > ".join(groups) + f", M={plan.micro_batches}" + (f", {plan.schedule}" if plan.schedule != "1f1b" else "")


def run_one(method: str, model: str, letter: str, batch: int, mbps: float, iterations: int, budget_s: float,
            dilation_guess: float) -> Run:  # fmt: skip
    from engine.runtime import rivals
    from engine.runtime.launcher import RunOptions, train
    from engine.workloads import workload

    w = workload(model)
    cluster = CLUSTERS[letter].with_bandwidth(mbps)
    run = Run(letter, model, batch, mbps, method, "ok")
    try:
        if method in RUNTIME_METHODS:
            plan = make_plan(method, Problem(w, cluster, batch))
            if not plan.predicted.fits:
                return _set(run, status="oom", predicted_s=plan.predicted.iteration_s, note="best plan does not fit")
        elif method == "ddp":
            plan = rivals.ddp_plan(w, cluster, batch)
        else:
            plan = rivals.pipelining_plan(w, cluster, batch, pipelining_micro_batches(batch, len(cluster.devices)))
    except NoFeasiblePlan as exc:
        return _set(run, status="oom", note=str(exc))
    from engine.costmodel import score
    from engine.simulator import simulate

    prediction = score(plan, w)
    run.predicted_s, run.shape = prediction.iteration_s, _shape(plan)
    run.simulated_s = simulate(plan, w).iteration_s
    if not prediction.fits:
        return _set(run, status="oom", note="does not fit in memory")
    estimate = STARTUP_S + iterations * prediction.iteration_s * dilation_guess
    if budget_s and estimate > budget_s:
        return _set(
            run, status="skipped", note=f"~{estimate / 60:.0f} min of wall time at dilation {dilation_guess:.0f}"
        )
    start = time.monotonic()
    try:
        if method in RUNTIME_METHODS:
            result = train(plan, w, RunOptions(iterations=iterations, emulate=True))
            measured, dilation = result.measured_iteration_s, result.dilation
            late, steps, loss = result.late_steps, result.steps, result.loss
        elif method == "ddp":
            result = rivals.run_ddp(w, cluster, batch, iterations=iterations)
        else:
            result = rivals.run_pipelining(w, cluster, batch, plan.micro_batches, iterations=iterations)
        if method not in RUNTIME_METHODS:
            measured, dilation = result.measured_iteration_s, result.dilation
            late, steps, loss = result.late_steps, result.steps, result.loss
    except UserError as exc:
        return _set(run, status="failed", note=str(exc), wall_s=time.monotonic() - start)
    return _set(
        run, measured_s=measured, dilation=dilation, late_steps=late, steps=steps, loss=loss,
        wall_s=time.monotonic() - start,
    )  # fmt: skip


def pipelining_micro_batches(batch: int, stages: int) -> int:
    """Two micro-batches per stage (1F1B's steady state needs at least one), at most one sample each."""
    m = min(batch, 2 * stages)
    while batch % m:
        m -= 1
    return m


def _set(run: Run, **values) -> Run:
    for k, v in values.items():
        setattr(run, k, v)
    return run


def reproduce(
    clusters: str = "ABCD",
    models: dict[str, int] | None = None,
    bandwidths: tuple[float, ...] = BANDWIDTHS,
    methods: tuple[str, ...] = METHODS,
    iterations: int = 2,
    budget_s: float = 120.0,
    progress: bool = False,
    record: Path | None = None,
) -> list[Run]:
    """Train every cell; `record` (JSON) is rewritten after each run so a long benchmark can be inspected."""
    models = models or MODELS
    # model by model (cheapest first in MODELS), so a partial record still holds whole models
    cells = [(m, b, c, bw) for m, b in models.items() for bw in bandwidths for c in clusters]
    runs: list[Run] = []
    dilation: dict[str, float] = {}
    with Progress(len(cells) * len(methods), "reproduce", progress) as bar:
        for model, batch, letter, mbps in cells:
            for method in methods:
                bar.update(0, f"{model} {letter} {mbps:g} {method}")
                run = run_one(method, model, letter, batch, mbps, iterations, budget_s,
                              dilation.get(letter, DEFAULT_DILATION))  # fmt: skip
                if run.dilation:
                    dilation[letter] = max(dilation.get(letter, 0.0), run.dilation)
                runs.append(run)
                bar.update(1)
                write_record(record, runs)
    return runs


def load_runs(paths: list[Path]) -> list[Run]:
    """Runs from records; a later run of the same cell and method replaces an earlier one, in its place."""
    return read_records(paths, Run, lambda r: (r.model, r.bandwidth_mbps, r.cluster, r.method), "reproduce")


class Cell(NamedTuple):
    """One model on one cluster at one bandwidth: the methods compared there."""

    bandwidth_mbps: float
    model: str
    batch_size: int
    cluster: str


def by_cell(runs: list[Run]) -> dict[Cell, dict[str, Run]]:
    """Runs grouped by cell (in the order cells first appear), then by method."""
    cells: dict[Cell, dict[str, Run]] = {}
    for r in runs:
        cells.setdefault(Cell(r.bandwidth_mbps, r.model, r.batch_size, r.cluster), {})[r.method] = r
    return cells


def speedup(ours: Run | None, other: Run | None) -> tuple[float | None, bool]:
    """Asteroid's speedup over `other`: measured when both ran, else predicted (flag False)."""
    if not ours or not other:
        return None, False
    if ours.throughput and other.throughput:
        return ours.throughput / other.throughput, True
    if ours.status in ("ok", "skipped") and other.status in ("ok", "skipped") and ours.expected_s and other.expected_s:
        return other.expected_s / ours.expected_s, False
    return None, False


@dataclass
class CellSummary:
    """One cell's runs and Asteroid's standing in it; a speedup is (value or None, measured)."""

    cell: Cell
    runs: dict[str, Run]  # by method
    ideal: float  # samples/s: every device's own throughput with the whole model, no communication
    vs_ddp: tuple[float | None, bool]
    vs_pipelines: list[tuple[float, bool]]  # over each of PIPELINES that has a speedup
    late_steps: int
    steps: int

    @property
    def vs_best_pipeline(self) -> tuple[float | None, bool]:
        """The speedup over the fastest other pipeline method (the smallest speedup)."""
        return min(self.vs_pipelines) if self.vs_pipelines else (None, False)

    @property
    def of_ideal(self) -> float | None:
        """Asteroid's measured throughput as a fraction of the ideal."""
        ours = self.runs.get("asteroid")
        return ours.throughput / self.ideal if ours and ours.throughput else None


def summarize(runs: list[Run]) -> list[CellSummary]:
    """Every cell, highest bandwidth first, then in the order the runs first name it."""
    from engine.workloads import workload

    cells = by_cell(runs)
    summaries = []
    for mbps in sorted({c.bandwidth_mbps for c in cells}, reverse=True):
        for cell, by in cells.items():
            if cell.bandwidth_mbps != mbps:
                continue
            ours = by.get("asteroid")
            pipes = [(s, m) for s, m in (speedup(ours, by.get(p)) for p in PIPELINES) if s is not None]
            summaries.append(
                CellSummary(
                    cell=cell,
                    runs=by,
                    ideal=ideal_throughput(workload(cell.model), CLUSTERS[cell.cluster]),
                    vs_ddp=speedup(ours, by.get("ddp")),
                    vs_pipelines=pipes,
                    late_steps=sum(r.late_steps for r in by.values()),
                    steps=sum(r.steps for r in by.values()),
                )
            )
    return summaries


@dataclass
class Claims:
    """The paper's claims checked against the measured cells (predicted speedups do not count)."""

    wins: int  # measured head-to-head comparisons Asteroid won with a plan of its own (speedup >= 1)
    comparisons: int
    ties: int  # ... where the rival ran Asteroid's own plan (`same_plan`): one plan measured twice
    tie_spread: float  # the largest |speedup - 1| among those: the measurement's own noise
    best_vs_ddp: tuple[float, str]  # (speedup, "model on cluster at N Mbps"); (0.0, "") when none was measured
    best_vs_pipeline: tuple[float, str]
    within: list[float]  # |measured / predicted - 1| of each cell where Asteroid ran

    @property
    def worst_within(self) -> float | None:
        return max(self.within) if self.within else None

    @property
    def median_within(self) -> float | None:
        return sorted(self.within)[len(self.within) // 2] if self.within else None


def same_plan(a: Run, b: Run) -> bool:
    """Whether two runs trained the same plan: the same shape and the same predictions to the last bit (records
    keep no more of the plan)."""
    return bool(a.shape) and (a.shape, a.predicted_s, a.simulated_s) == (b.shape, b.predicted_s, b.simulated_s)


def claims(summaries: list[CellSummary]) -> Claims:
    """Wins, the largest measured speedups (the first cell in `summaries` order on a tie) and prediction error."""
    best = {"ddp": (0.0, ""), "pipe": (0.0, "")}
    wins = comparisons = ties = 0
    spread, within = 0.0, []
    for s in summaries:
        c = s.cell
        for key, (v, measured) in (("ddp", s.vs_ddp), ("pipe", s.vs_best_pipeline)):
            if v and measured and v > best[key][0]:
                best[key] = (v, f"{c.model} on {c.cluster} at {c.bandwidth_mbps:g} Mbps")
        ours = s.runs.get("asteroid")
        for method in ("ddp", *PIPELINES):
            other = s.runs.get(method)
            v, measured = speedup(ours, other)
            if v is None or not measured:
                continue
            comparisons += 1
            if same_plan(ours, other):
                ties += 1
                spread = max(spread, abs(v - 1))
            else:
                wins += v >= 1
        if ours and ours.status == "ok":
            within.append(abs(ours.measured_s / ours.expected_s - 1))
    return Claims(wins, comparisons, ties, spread, best["ddp"], best["pipe"], within)
