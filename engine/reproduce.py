"""`python -m engine bench reproduce`: the Asteroid paper's comparison, trained for real on emulated clusters A-D.

Every cell trains one model on one cluster at one bandwidth with each method, in one process per device,
under the same time-dilation emulation: the asteroid, pipedream and ftpipehd plans on the Asteroid
runtime, PyTorch DDP over every device, and torch.distributed.pipelining (1F1B, an even split). A run
whose estimated wall time is over the per-run budget is not trained; the report says so and shows the
cost model's prediction in its place, marked as such.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    predicted_s: float | None = None
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
    def predicted_throughput(self) -> float | None:
        return self.batch_size / self.predicted_s if self.predicted_s else None


def _shape(plan) -> str:
    """e.g. 'tx2x2 > nanox3 > nx, M=4'."""
    groups = []
    for st in plan.stages:
        kinds: dict[str, int] = {}
        for s in st.devices:
            kind = SHORT.get(plan.cluster.device(s.name).kind, "custom")
            kinds[kind] = kinds.get(kind, 0) + 1
        groups.append("+".join(f"{k}x{n}" if n > 1 else k for k, n in kinds.items()))
    return " > ".join(groups) + f", M={plan.micro_batches}"


def run_one(method: str, model: str, letter: str, batch: int, mbps: float, iterations: int, budget_s: float,
            dilation_guess: float) -> Run:  # fmt: skip
    from engine.runtime import peers
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
            plan = peers.ddp_plan(w, cluster, batch)
        else:
            plan = peers.pipelining_plan(w, cluster, batch, pipelining_micro_batches(batch, len(cluster.devices)))
    except NoFeasiblePlan as exc:
        return _set(run, status="oom", note=str(exc))
    from engine.costmodel import score

    prediction = score(plan, w)
    run.predicted_s, run.shape = prediction.iteration_s, _shape(plan)
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
            result = peers.run_ddp(w, cluster, batch, iterations=iterations)
        else:
            result = peers.run_pipelining(w, cluster, batch, plan.micro_batches, iterations=iterations)
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
                if record:
                    record.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return runs


def load_runs(paths: list[Path]) -> list[Run]:
    """Runs from records; a later run of the same cell and method replaces an earlier one, in its place."""
    runs: dict[tuple, Run] = {}
    for path in paths:
        try:
            docs = json.loads(path.read_text())
            loaded = [Run(**doc) for doc in docs]
        except FileNotFoundError:
            raise UserError(f"record {path} does not exist") from None
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"record {path} is not a reproduce record: {exc}") from None
        for r in loaded:
            runs[(r.model, r.bandwidth_mbps, r.cluster, r.method)] = r
    return list(runs.values())


def _by_cell(runs: list[Run]) -> dict[tuple, dict[str, Run]]:
    cells: dict[tuple, dict[str, Run]] = {}
    for r in runs:
        cells.setdefault((r.bandwidth_mbps, r.model, r.batch_size, r.cluster), {})[r.method] = r
    return cells


def _speed(ours: Run | None, other: Run | None) -> tuple[float | None, bool]:
    """Asteroid's speedup over `other`: measured when both ran, else predicted (flag False)."""
    if not ours or not other:
        return None, False
    if ours.throughput and other.throughput:
        return ours.throughput / other.throughput, True
    if (
        ours.status in ("ok", "skipped")
        and other.status in ("ok", "skipped")
        and ours.predicted_s
        and other.predicted_s
    ):
        return other.predicted_s / ours.predicted_s, False
    return None, False


def report(runs: list[Run], command: str) -> str:
    """Markdown: per bandwidth, throughput of every method and Asteroid's speedups; then every run in detail."""
    from engine.workloads import workload

    cells = _by_cell(runs)
    fmt_x = lambda v, measured: "n/a" if v is None else f"{v:.2f}x" if measured else f"({v:.2f}x pred.)"  # noqa: E731
    lines = [
        "## Reproduction: trained for real on emulated clusters A-D",
        "",
        f"Command: `{command}` (on {platform.machine()}, {_cores()} cores, Python {platform.python_version()}).",
        "",
        "Every number below is measured in **device time** (wall time / dilation) from real training "
        "in one process per device, except where marked *pred.*: those runs were over the per-run wall-time "
        "budget and show the cost model's prediction instead. Throughput in samples/s; after it, in brackets, "
        "the measured iteration time over the predicted one. `OOM`: the method's plan does not fit in memory.",
        "",
    ]
    best = {"ddp": (0.0, ""), "pipe": (0.0, "")}
    losses = wins = 0
    within = []
    for mbps in sorted({k[0] for k in cells}, reverse=True):
        lines += [
            f"### {mbps:g} Mbps",
            "",
            "| model (batch) | cluster | ideal | " + " | ".join(METHODS) + " | vs ddp | vs best pipeline | "
            "asteroid / ideal | late steps |",
            "|---|---|---|" + "---|" * len(METHODS) + "---|---|---|---|",
        ]
        for (bw, model, batch, letter), by in cells.items():
            if bw != mbps:
                continue
            w = workload(model)
            ideal = ideal_throughput(w, CLUSTERS[letter])
            ours = by.get("asteroid")
            row = [f"{model} ({batch})", letter, f"{ideal:.0f}"]
            for m in METHODS:
                r = by.get(m)
                if r is None:
                    row.append("-")
                elif r.status == "ok":
                    row.append(f"{r.throughput:.1f} ({r.measured_s / r.predicted_s:.2f})")
                elif r.status == "skipped":
                    row.append(f"{r.predicted_throughput:.1f} pred.")
                else:
                    row.append(r.status.upper() if r.status == "oom" else "failed")
            vs_ddp, m_ddp = _speed(ours, by.get("ddp"))
            pipes = [(s, m) for s, m in (_speed(ours, by.get(p)) for p in PIPELINES) if s is not None]
            vs_pipe, m_pipe = min(pipes) if pipes else (None, False)
            for key, v, measured in (("ddp", vs_ddp, m_ddp), ("pipe", vs_pipe, m_pipe)):
                if v and measured and v > best[key][0]:
                    best[key] = (v, f"{model} on {letter} at {mbps:g} Mbps")
            for s, measured in [(vs_ddp, m_ddp), *pipes]:
                if s is not None and measured:
                    wins += s >= 1
                    losses += s < 1
            if ours and ours.status == "ok":
                within.append(abs(ours.measured_s / ours.predicted_s - 1))
            late = sum(r.late_steps for r in by.values())
            steps = sum(r.steps for r in by.values())
            frac = f"{ours.throughput / ideal:.2f}" if ours and ours.throughput else "n/a"
            row += [fmt_x(vs_ddp, m_ddp), fmt_x(vs_pipe, m_pipe), frac, f"{late}/{steps}"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "### Against the paper's claims",
        "",
        f"- Measured head-to-head comparisons Asteroid won: {wins} of {wins + losses}.",
        f"- Largest measured speedup over data parallelism (DDP): {best['ddp'][0]:.2f}x ({best['ddp'][1]}) "
        "(paper: up to 12.2x).",
        f"- Largest measured speedup over the best other pipeline method: {best['pipe'][0]:.2f}x "
        f"({best['pipe'][1]}) (paper: up to 2.1x).",
    ]
    if within:
        lines.append(
            f"- Asteroid's measured iteration time against the prediction: within {100 * max(within):.1f} % "
            f"in every measured cell (median {100 * sorted(within)[len(within) // 2]:.1f} %)."
        )
    lines += ["", "### Every run", "", "| bandwidth | model | cluster | method | plan | status | dilation | "
              "measured s | predicted s | loss first -> last | late/steps | wall s | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        loss = f"{r.loss[0]:.3f} -> {r.loss[-1]:.3f}" if r.loss else ""
        lines.append(
            f"| {r.bandwidth_mbps:g} | {r.model} | {r.cluster} | {r.method} | {r.shape} | {r.status} | "
            f"{r.dilation or 0:.0f} | {r.measured_s or 0:.4f} | {r.predicted_s or 0:.4f} | {loss} | "
            f"{r.late_steps}/{r.steps} | {r.wall_s:.0f} | {r.note} |"
        )
    return "\n".join(lines)


def _cores() -> int:
    from engine.runtime.emulation import host_cores

    return host_cores()


def figure(runs: list[Run], prefix: Path) -> list[Path]:
    """Grouped bars of measured throughput per method and cell, one panel per bandwidth: HTML, and PNG
    when a static-image engine (kaleido with a Chromium) is available."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cells = _by_cell(runs)
    bandwidths = sorted({k[0] for k in cells}, reverse=True)
    fig = make_subplots(
        rows=len(bandwidths), cols=1, subplot_titles=[f"{b:g} Mbps" for b in bandwidths], vertical_spacing=0.12
    )
    colors = dict(zip(METHODS, ("#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#ff7f0e")))
    for row, mbps in enumerate(bandwidths, start=1):
        keys = [k for k in cells if k[0] == mbps]
        x = [f"{k[1]} / {k[3]}" for k in keys]
        for m in METHODS:
            y = [cells[k][m].throughput if m in cells[k] and cells[k][m].throughput else None for k in keys]
            fig.add_trace(
                go.Bar(name=m, x=x, y=y, marker_color=colors[m], showlegend=row == 1, legendgroup=m), row=row, col=1
            )
        fig.update_yaxes(title_text="samples/s (device time)", type="log", row=row, col=1)
    fig.update_layout(
        title="Measured training throughput on emulated Jetson clusters (higher is better)",
        barmode="group",
        height=420 * len(bandwidths),
        width=1400,
    )
    prefix.parent.mkdir(parents=True, exist_ok=True)
    html = prefix.with_suffix(".html")
    fig.write_html(html, include_plotlyjs="directory")
    written = [html]
    try:
        fig.write_image(prefix.with_suffix(".png"))
        written.append(prefix.with_suffix(".png"))
    except Exception as exc:  # kaleido or a browser missing: the HTML is the figure
        print(f"note: PNG not written ({str(exc).splitlines()[0][:120]})", file=sys.stderr)
    return written
