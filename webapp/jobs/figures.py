"""Plotly figures of the job pages: a plan's pipeline and memory, the methods compared, a timeline of steps."""

from __future__ import annotations

import json
from collections.abc import Mapping
from html import escape
from typing import Any

import plotly.graph_objects as go

from engine.devices import GIB
from engine.plan import Plan, Prediction
from webapp.jobs.rows import KIND_LABELS, METHOD_LABELS, comparison_rows, device_rows, unused_devices

FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif'
ACCENT = "#2d5bd7"
MUTED = "#5b6475"
# The figures sit on the page's card, light or dark (static/css/site.css): transparent backgrounds, greys that are
# half-transparent, and the text in the page's own colour (static/js/figures.js sets it from the CSS; TEXT is the
# light page's, for a figure drawn elsewhere). Side notes are the text colour at reduced opacity.
TEXT = "#1d2330"
GRID = "rgba(128, 128, 128, 0.28)"
NEUTRAL_FILL = "rgba(128, 128, 128, 0.18)"
NEUTRAL_LINE = "rgba(128, 128, 128, 0.6)"
NOTE_OPACITY = 0.75
BAD = "#c53030"

KIND_COLORS = {
    "jetson-xavier-nx": "#2d5bd7",
    "jetson-tx2": "#1f8a4c",
    "jetson-nano": "#b7791f",
    "custom": "#7c3aed",
}

# Step kinds of engine.events, grouped as the timeline shows them (static/js/live.js uses the same colours).
STEP_GROUPS = {
    "F": "forward", "B": "backward", "W": "weight gradient", "send": "transfer", "recv": "transfer",
    "all-reduce": "all-reduce",
}  # fmt: skip
STEP_COLORS = {
    "forward": "#2d5bd7", "backward": "#e07b39", "weight gradient": "#b8860b", "transfer": "#9aa3b2",
    "all-reduce": "#1f8a4c",
}  # fmt: skip


def _esc(name: str) -> str:
    """A name (device, kind, planner message) as Plotly text: Plotly reads `<a href>`, `<b>`, `<br>` in labels, hover
    texts and tick labels as markup, so a device named `<a href=...>` would show a link; escaped, it shows as text."""
    return escape(str(name))


def _layout(title: str, **extra: Any) -> dict:
    """A plain layout in the site's look: system fonts, transparent background, light grid; the title at the top left
    and the legend at the bottom, each making room for itself (a legend that wraps on a phone covers neither the title
    nor the plot; static/js/figures.js makes a long title smaller on a narrow screen rather than cut)."""
    base = {
        "title": {
            "text": title, "font": {"size": 16}, "automargin": True,  # the top margin makes room for it
            "xref": "container", "x": 0, "xanchor": "left", "yref": "container", "y": 1, "yanchor": "top",
            "pad": {"l": 14, "t": 12, "b": 6},
        },
        "template": "none",
        "autosize": True,  # full width of its box; the height is the figure's own
        "font": {"family": FONT, "size": 13, "color": TEXT},
        "paper_bgcolor": "rgba(0, 0, 0, 0)",
        "plot_bgcolor": "rgba(0, 0, 0, 0)",
        "margin": {"l": 70, "r": 20, "t": 50, "b": 40},
        "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "bottom", "yref": "container"},
        "hoverlabel": {"font": {"family": FONT}},
    }  # fmt: skip
    base.update(extra)
    return base


def _axis(title: str, **extra: Any) -> dict:
    return {"title": {"text": title}, "gridcolor": GRID, "zerolinecolor": GRID, "automargin": True, **extra}


def _plain(fig: go.Figure) -> dict:
    """The figure as a JSON-ready dict with only `data` and `layout`."""
    doc = json.loads(fig.to_json())
    return {"data": doc.get("data", []), "layout": doc.get("layout", {})}


def pipeline_figure(plan: Plan) -> dict:
    """Stages as columns, each stage's devices stacked in its column with box height = share of a micro-batch."""
    mbs = plan.micro_batch_size
    fig = go.Figure()
    shown_kinds: set[str] = set()
    stages = plan.stages
    ticks = []
    rows = device_rows(plan)
    for k, st in enumerate(stages):
        start, end = st.start, st.end
        x = f"stage {k}"
        ticks.append(f"stage {k}<br>layers [{start}, {end})")
        # Plotly stacks traces bottom-up: add the stage's devices in reverse so the first one is on top.
        for row in reversed([r for r in rows if r["stage"] == k]):
            kind, device = row["kind"], _esc(row["device"])
            share = f"{row['samples']} of {mbs} samples" if mbs else f"{row['samples']} samples"
            big = mbs and row["samples"] / mbs >= 0.25
            text = f"<b>{device}</b><br>{row['layers']}<br>{share}" if big else f"<b>{device}</b> · {share}"
            fig.add_trace(
                go.Bar(
                    x=[x],
                    y=[row["samples"]],
                    name=_esc(KIND_LABELS.get(kind, kind)),
                    legendgroup=kind,
                    showlegend=kind not in shown_kinds,
                    marker={"color": KIND_COLORS.get(kind, MUTED), "line": {"color": "#ffffff", "width": 2}},
                    text=[text],
                    textposition="inside",
                    insidetextanchor="middle",
                    textfont={"color": "#ffffff"},
                    hovertext=[
                        f"{device} ({_esc(row['kind_label'])})<br>stage {k}, layers {row['layers']}<br>{share}"
                        + (f"<br>predicted memory {row['memory_gib']:.2f} GiB" if row["memory_gib"] is not None else "")
                    ],
                    hoverinfo="text",
                    meta={"device": row["device"], "layers": [start, end], "samples": row["samples"]},
                )
            )
            shown_kinds.add(kind)
    annotations = []
    spare = unused_devices(plan)
    if spare:
        annotations.append(
            {
                "text": "not used: " + ", ".join(_esc(name) for name in spare),
                "xref": "paper",
                "yref": "paper",
                "x": 1,
                "y": 1.0,
                "xanchor": "right",
                "yanchor": "bottom",
                "showarrow": False,
                "opacity": NOTE_OPACITY,
            }
        )
    method = METHOD_LABELS.get(plan.method, plan.method)
    fig.update_layout(
        **_layout(
            f"{method} pipeline: {_count(len(stages), 'stage', 'stages')}, "
            f"{_count(plan.micro_batches, 'micro-batch', 'micro-batches')} of {mbs} samples",
            barmode="stack",
            bargap=0.25,
            height=420,
            uniformtext={"minsize": 10, "mode": "hide"},
            annotations=annotations,
            xaxis=_axis(
                "stage (layers [start, end))",
                categoryorder="array",
                categoryarray=[f"stage {k}" for k in range(len(stages))],
                tickvals=[f"stage {k}" for k in range(len(stages))],
                ticktext=ticks,
                showgrid=False,
            ),
            yaxis=_axis("samples of each micro-batch", range=[0, max(mbs, 1)], dtick=_nice_step(mbs)),
        )
    )
    return _plain(fig)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _nice_step(total: int) -> float | None:
    if total <= 0:
        return None
    for step in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 250, 256, 500, 1000):
        if total / step <= 8:
            return step
    return None


def memory_figure(plan: Plan) -> dict:
    """Predicted memory per device (GiB) in front of its usable capacity (memory − reserved).

    The predicted bars are one trace per device kind, in the kind's colour, and one in red for the devices whose
    prediction is over their usable memory: the legend names every colour the bars have."""
    rows = device_rows(plan)
    memory = plan.predicted.memory_bytes if plan.predicted else {}
    names = [r["device"] for r in rows]
    labels_x = [_esc(n) for n in names]  # the category axis prints them, and the hover's %{x}
    used = [r["memory_gib"] for r in rows]
    capacity = [r["capacity_gib"] for r in rows]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=labels_x,
            y=capacity,
            name="usable memory",
            marker={"color": NEUTRAL_FILL, "line": {"color": NEUTRAL_LINE, "width": 1}},
            width=0.7,
            hovertemplate="%{x}: %{y:.2f} GiB usable<extra></extra>",
        )
    )
    groups: dict[str, list[int]] = {}  # legend entry -> the rows it draws, in the kinds' order of appearance
    for i, r in enumerate(rows):
        over = r["fits"] is False
        groups.setdefault("over" if over else r["kind"], []).append(i)
    if "over" in groups:
        groups["over"] = groups.pop("over")  # last in the legend
    for group, picked in groups.items():
        if group == "over":
            name, color = "predicted peak, over usable memory", BAD
        else:
            name, color = f"predicted peak, {_esc(KIND_LABELS.get(group, group))}", KIND_COLORS.get(group, ACCENT)
        labels = []
        for i in picked:
            r = rows[i]
            if r["memory_gib"] is None:
                labels.append("")
            elif r["capacity_gib"]:
                labels.append(f"{r['memory_gib']:.2f} GiB<br>{100 * r['memory_gib'] / r['capacity_gib']:.0f}%")
            else:
                labels.append(f"{r['memory_gib']:.2f} GiB")
        fig.add_trace(
            go.Bar(
                x=[labels_x[i] for i in picked],
                y=[memory.get(names[i], 0) / GIB for i in picked],
                name=name,
                marker={"color": color},
                width=0.4,
                text=labels,
                textposition="outside",
                cliponaxis=False,
                hovertemplate="%{x}: %{y:.3f} GiB predicted<extra></extra>",
                meta={"devices": [names[i] for i in picked]},
            )
        )
    annotations = []
    if not memory:
        annotations.append(_note("no memory prediction for this plan"))
    top = max([c for c in capacity if c] + [u for u in used if u] + [0.1])
    fig.update_layout(
        **_layout(
            "Predicted memory per device against its usable memory",
            barmode="overlay",
            height=400,
            uniformtext={"minsize": 10, "mode": "hide"},  # a label wider than its bar is left out, never overlapped
            annotations=annotations,
            xaxis=_axis("device", categoryorder="array", categoryarray=labels_x, showgrid=False),
            yaxis=_axis("memory (GiB)", range=[0, top * 1.12]),
        )
    )
    return _plain(fig)


def _note(text: str) -> dict:
    return {
        "text": text,
        "xref": "paper",
        "yref": "paper",
        "x": 0.5,
        "y": 0.5,
        "showarrow": False,
        "font": {"size": 14},
        "opacity": NOTE_OPACITY,
    }


def comparison_figure(comparison: Mapping[str, Prediction | str]) -> dict:
    """Horizontal bars of predicted throughput per method; Asteroid highlighted; "no plan" where a method failed.

    `comparison` maps each method to its plan's prediction or to why it has none (rows.predictions)."""
    rows = comparison_rows(comparison)
    labels = [_esc(r["label"]) for r in rows]
    with_plan = [r for r in rows if r["throughput"] is not None]
    texts, hovers = [], []
    for r in with_plan:
        tp = f"{r['throughput']:,.0f} samples/s"
        if r["method"] == "asteroid":
            speed = ""
        elif r["speedup"] is not None:
            speed = f"Asteroid {r['speedup']:.2f}× faster"
        else:
            speed = ""
        fits = "" if r["fits"] else " · does not fit in memory"
        second = " · ".join(part for part in (speed, fits.removeprefix(" · ")) if part)
        texts.append(tp + (f"<br>{second}" if second else ""))  # two short lines: room beside a short bar on a phone
        hovers.append(
            f"<b>{_esc(r['label'])}</b><br>{tp}<br>iteration {1000 * r['iteration_s']:.1f} ms"
            + (f"<br>Asteroid speedup {r['speedup']:.2f}×" if r["speedup"] is not None else "")
            + fits.replace(" · ", "<br>")
        )
    fig = go.Figure(
        go.Bar(
            y=[_esc(r["label"]) for r in with_plan],
            x=[r["throughput"] for r in with_plan],
            orientation="h",
            name="predicted throughput",
            marker={
                "color": [ACCENT if r["method"] == "asteroid" else "#a3abba" for r in with_plan],
                "pattern": {"shape": ["" if r["fits"] else "/" for r in with_plan]},
            },
            text=texts,
            textposition="auto",
            hovertext=hovers,
            hoverinfo="text",
            customdata=[[r["method"], r["speedup"]] for r in with_plan],
        )
    )
    annotations = [
        {
            "text": f"no plan: {_esc(_short(r['error']))}",
            "hovertext": _esc(r["error"]),
            "x": 0,
            "y": _esc(r["label"]),
            "xref": "x",
            "yref": "y",
            "xanchor": "left",
            "showarrow": False,
            "font": {"size": 12},
            "opacity": NOTE_OPACITY,
        }
        for r in rows
        if r["throughput"] is None
    ]
    best = max([r["throughput"] for r in with_plan] + [1.0])
    fig.update_layout(
        **_layout(
            "Predicted throughput by planning method",
            height=90 + 52 * max(len(rows), 1),
            showlegend=False,
            annotations=annotations,
            xaxis=_axis("predicted samples/s", range=[0, best * 1.05], rangemode="tozero"),
            yaxis=_axis("", categoryorder="array", categoryarray=labels, autorange="reversed", showgrid=False),
        )
    )
    return _plain(fig)


def _short(text: str, limit: int = 70) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def timeline_figure(steps: list[dict], devices: list[str], title: str) -> dict:
    """A Gantt of step events: one row per device (first on top), bars from start to end coloured by kind."""
    order = list(devices) + sorted({s["device"] for s in steps} - set(devices))
    fig = go.Figure()
    for group, color in STEP_COLORS.items():
        chosen = [s for s in steps if STEP_GROUPS.get(s["kind"], "transfer") == group]
        if not chosen:
            continue
        fig.add_trace(
            go.Bar(
                y=[_esc(s["device"]) for s in chosen],
                x=[s["end"] - s["start"] for s in chosen],
                base=[s["start"] for s in chosen],
                orientation="h",
                name=group,
                marker={"color": color, "line": {"color": "#ffffff", "width": 0.5}},
                text=[_esc(s["micro_batch"]) if s["kind"] in ("F", "B", "W") else "" for s in chosen],
                textposition="inside",
                insidetextanchor="middle",
                textfont={"color": "#ffffff"},
                hovertext=[_step_hover(s) for s in chosen],
                hoverinfo="text",
                # a device's link sends while it computes: transfers are a thin strip at the row's edge
                **({"width": 0.2, "offset": 0.15} if group == "transfer" else {}),
            )
        )
    annotations = [] if steps else [_note("no steps yet")]
    fig.update_layout(
        **_layout(
            title,
            barmode="overlay",
            bargap=0.3,
            height=110 + 34 * max(len(order), 1),
            uniformtext={"minsize": 8, "mode": "hide"},
            annotations=annotations,
            xaxis=_axis("device time (s)", rangemode="tozero"),
            yaxis=_axis(
                "", categoryorder="array", categoryarray=[_esc(d) for d in order], autorange="reversed", showgrid=False
            ),
        )
    )
    return _plain(fig)


def _step_hover(s: dict) -> str:
    names = {"F": "forward", "B": "backward", "W": "weight gradient", "send": "send", "recv": "receive"}
    what = names.get(s["kind"], _esc(s["kind"]))
    head = f"{_esc(s['device'])} · {what}"
    if s.get("micro_batch", -1) >= 0:
        head += f" micro-batch {s['micro_batch']}"
    if s.get("peer"):
        head += (" to " if s["kind"] == "send" else " from ") + _esc(s["peer"])
    return (
        f"{head}<br>stage {_esc(s.get('stage'))}, iteration {_esc(s.get('iteration', 0))}<br>"
        f"{s['start'] * 1000:.2f} – {s['end'] * 1000:.2f} ms ({(s['end'] - s['start']) * 1000:.2f} ms)"
    )


COMPARED = ("#2d5bd7", "#e07b39", "#1f8a4c", "#c53030", "#805ad5", "#5b6475")  # one colour per compared job


def compare_figures(series: list[dict]) -> dict[str, dict]:
    """Jobs compared (`series`: [{name, iterations: [iteration messages]}]): throughput and loss per iteration."""
    out = {}
    for metric, title, axis in (("throughput", "Throughput", "samples/s"), ("loss", "Training loss", "loss")):
        fig = go.Figure()
        for k, s in enumerate(series):
            its = [it for it in s["iterations"] if isinstance(it.get(metric), (int, float))]
            fig.add_trace(go.Scatter(
                x=[it["iteration"] + 1 for it in its], y=[it[metric] for it in its], mode="lines+markers",
                name=_esc(s["name"]), line={"color": COMPARED[k % len(COMPARED)], "width": 2}, marker={"size": 4},
                hovertemplate=f"{_esc(s['name'])}, iteration %{{x}}: %{{y:.4g}} {axis}<extra></extra>",
            ))  # fmt: skip
        y = _axis(axis, rangemode="tozero" if metric == "throughput" else "normal")
        fig.update_layout(_layout(title, height=340, xaxis=_axis("iteration", rangemode="tozero"), yaxis=y))
        out[metric] = _plain(fig)
    return out
