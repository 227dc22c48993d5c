"""The reproduction benchmark's summaries as a markdown report and a Plotly figure (HTML, PNG through kaleido)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from engine.bench.reproduce import METHODS, PIPELINES, CellSummary, Run, by_cell, claims, same_plan, speedup, summarize


def _speedup(value: float | None, measured: bool) -> str:
    return "n/a" if value is None else f"{value:.2f}x" if measured else f"({value:.2f}x pred.)"


def _largest(best: tuple[float, str]) -> str:
    """A claim's largest measured speedup and where, or that no cell measured both sides."""
    return f"{best[0]:.2f}x ({best[1]})" if best[1] else "none measured (no cell ran both)"


def _vs_best_pipeline(s: CellSummary) -> str:
    """Asteroid's speedup over the fastest other pipeline method, marked when that method ran Asteroid's plan."""
    text = _speedup(*s.vs_best_pipeline)
    ours = s.runs.get("asteroid")
    for m in PIPELINES:
        other = s.runs.get(m)
        if ours and other and speedup(ours, other) == s.vs_best_pipeline and same_plan(ours, other):
            return f"{text} (same plan)"
    return text


def _outcome(r: Run | None) -> str:
    """A method's cell in the throughput table: measured (with measured / predicted), predicted, or why not."""
    if r is None:
        return "-"
    if r.status == "ok":
        return f"{r.throughput:.1f} ({r.measured_s / r.expected_s:.2f})"
    if r.status == "skipped":
        return f"{r.predicted_throughput:.1f} pred."
    return r.status.upper() if r.status == "oom" else "failed"


def report(runs: list[Run], command: str) -> str:
    """Markdown: per bandwidth, throughput of every method and Asteroid's speedups; then every run in detail."""
    summaries = summarize(runs)
    lines = [
        "## Reproduction: trained for real on emulated clusters A-D",
        "",
        f"Command: `{command}` (on {platform.machine()}, {_cores()} cores, Python {platform.python_version()}).",
        "",
        "Every number below is measured in **device time** (wall time / dilation) from real training "
        "in one process per device, except where marked *pred.*: those runs were over the per-run wall-time "
        "budget and show the cost model's prediction instead. Throughput in samples/s; after it, in brackets, "
        "the measured iteration time over the predicted one (the simulated iteration, engine.simulator; the "
        "closed form's in runs recorded before the simulator was recorded). `OOM`: the method's plan does not "
        "fit in memory.",
        "",
    ]
    for mbps in sorted({s.cell.bandwidth_mbps for s in summaries}, reverse=True):
        lines += [
            f"### {mbps:g} Mbps",
            "",
            "| model (batch) | cluster | ideal | " + " | ".join(METHODS) + " | vs ddp | vs best pipeline | "
            "asteroid / ideal | late steps |",
            "|---|---|---|" + "---|" * len(METHODS) + "---|---|---|---|",
        ]
        for s in summaries:
            if s.cell.bandwidth_mbps != mbps:
                continue
            row = [f"{s.cell.model} ({s.cell.batch_size})", s.cell.cluster, f"{s.ideal:.0f}"]
            row += [_outcome(s.runs.get(m)) for m in METHODS]
            frac = "n/a" if s.of_ideal is None else f"{s.of_ideal:.2f}"
            row += [_speedup(*s.vs_ddp), _vs_best_pipeline(s), frac, f"{s.late_steps}/{s.steps}"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    c = claims(summaries)
    lines += [
        "### Against the paper's claims",
        "",
        f"- Measured head-to-head comparisons: Asteroid won {c.wins} and lost {c.comparisons - c.wins - c.ties} of "
        f"{c.comparisons}; in the other {c.ties} the rival's planner chose Asteroid's own plan, so one plan was "
        f"measured twice (within {100 * c.tie_spread:.1f} % of itself).",
        f"- Largest measured speedup over data parallelism (DDP): {_largest(c.best_vs_ddp)} (paper: up to 12.2x).",
        f"- Largest measured speedup over the best other pipeline method: {_largest(c.best_vs_pipeline)} (paper: up "
        "to 2.1x).",
    ]
    if c.within:
        lines.append(
            f"- Asteroid's measured iteration time against the prediction: within {100 * c.worst_within:.1f} % "
            f"in every measured cell (median {100 * c.median_within:.1f} %)."
        )
    lines += ["", "### Every run", "", "| bandwidth | model | cluster | method | plan | status | dilation | "
              "measured s | simulated s | closed form s | loss first -> last | late/steps | wall s | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        loss = f"{r.loss[0]:.3f} -> {r.loss[-1]:.3f}" if r.loss else ""
        lines.append(
            f"| {r.bandwidth_mbps:g} | {r.model} | {r.cluster} | {r.method} | {r.shape} | {r.status} | "
            f"{r.dilation or 0:.0f} | {r.measured_s or 0:.4f} | "
            f"{f'{r.simulated_s:.4f}' if r.simulated_s else '-'} | {r.predicted_s or 0:.4f} | {loss} | "
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

    cells = by_cell(runs)
    bandwidths = sorted({c.bandwidth_mbps for c in cells}, reverse=True)
    fig = make_subplots(
        rows=len(bandwidths), cols=1, subplot_titles=[f"{b:g} Mbps" for b in bandwidths], vertical_spacing=0.12
    )
    colors = dict(zip(METHODS, ("#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#ff7f0e")))
    for row, mbps in enumerate(bandwidths, start=1):
        keys = [c for c in cells if c.bandwidth_mbps == mbps]
        x = [f"{c.model} / {c.cluster}" for c in keys]
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
    return write_figure(fig, prefix, plotlyjs="directory")


def write_figure(fig, prefix: Path, plotlyjs: str = "cdn", png: bool = True) -> list[Path]:
    """Write a Plotly figure as prefix.html (plotly.js as `include_plotlyjs`: "cdn" keeps a figure for docs/ one
    small file) and, with `png`, prefix.png when a static-image engine (kaleido with a Chromium) is available;
    returns the paths written."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    html = prefix.with_suffix(".html")
    fig.write_html(html, include_plotlyjs=plotlyjs)
    written = [html]
    if png:
        try:
            fig.write_image(prefix.with_suffix(".png"))
            written.append(prefix.with_suffix(".png"))
        except Exception as exc:  # kaleido or a browser missing: the HTML is the figure
            print(f"note: PNG not written ({str(exc).splitlines()[0][:120]})", file=sys.stderr)
    return written
