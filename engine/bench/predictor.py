"""`bench predictor`: leave-one-configuration-out accuracy of per-layer latency predictions, and the plans they make.

For each measured configuration in turn, the predictor is fitted on the others and the held-out one is known only
by its probe. Methods: flops (FLOPs / the probe's FLOP rate), scaled (a reference configuration's measured times
times one factor from the probe: how the engine scales a known kind today), regressor and completion (each half of
the predictor alone, no adaptation: what their average adds), predictor (no adaptation), adapted
(its correction fitted on the probe), continual (then updated with the measured step time of one stage of the
model being trained). And the floor under all of them: the same configuration measured twice ("re-measured").
Plans: the Asteroid planner on two held-out devices and two reference ones, from each method's tables, scored
with the held-out device's true times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.predictor.adapt import DeviceModel
from engine.predictor.completion import complete
from engine.predictor.features import LAYER_FEATURES, layer_features
from engine.predictor.model import Predictor
from engine.predictor.probe import PROBE_BATCH, PROBE_KEYS, from_measurements, probe_vector
from engine.progress import Progress

METHODS = ("flops", "scaled", "regressor", "completion", "predictor", "adapted", "continual")
NOISE = "re-measured"  # the same configuration measured again (python -m engine.predictor measure --repeat)
REFERENCE = "fp32-1t"  # what the engine profiles on (one thread, float32)
STAGES = (2, 3, 4)  # stage errors: every stage of even splits of each model into this many stages
PLAN_BATCH = 32
FWD, BWD = LAYER_FEATURES.index("fwd_flops"), LAYER_FEATURES.index("bwd_flops")


@dataclass
class _CompletionOnly:
    """A predictor's low-rank completion without its regressor, as DeviceModel asks a predictor."""

    predictor: Predictor

    def predict(self, model: str, micro_batch: int, probe: dict) -> tuple[np.ndarray, np.ndarray]:
        y = np.exp(complete(self.predictor.columns, model, micro_batch, probe_vector(probe)))
        n = len(y) // 2
        return y[:n], y[n:]


@dataclass
class Scores:
    """One method on one held-out configuration: relative errors per layer and per stage, plan throughput ratios."""

    layer: list[float]
    stage: list[float]
    plan: list[float]


def _truth(doc: dict, config: str, model: str, mb: int) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(doc["configs"][config][model][str(mb)], dtype=float)
    return t[:, 0], t[:, 1]


def _ranges(n: int) -> list[tuple[int, int]]:
    out = []
    for k in STAGES:
        cuts = [round(i * n / k) for i in range(k + 1)]
        out += [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return out


def _flops(model: str, probe: dict) -> tuple[np.ndarray, np.ndarray]:
    """Time proportional to FLOPs, at the probe's FLOP rate per direction."""
    rates = []
    for d, col in ((0, FWD), (1, BWD)):
        flops = sum(layer_features(k.split(":")[0])[int(k.split(":")[1]), col] for k in PROBE_KEYS)
        rates.append(flops / sum(probe[k][d] for k in PROBE_KEYS))
    raw = layer_features(model)
    return raw[:, FWD] / rates[0], raw[:, BWD] / rates[1]


def _scaled(doc: dict, reference: str, model: str, mb: int, probe: dict) -> tuple[np.ndarray, np.ndarray]:
    """The reference configuration's measured times, times the ratio of the two probes' totals per direction."""
    ref_probe = from_measurements({m: v[str(PROBE_BATCH)] for m, v in doc["configs"][reference].items()})
    f, b = _truth(doc, reference, model, mb)
    ratio = [sum(probe[k][d] for k in PROBE_KEYS) / sum(ref_probe[k][d] for k in PROBE_KEYS) for d in (0, 1)]
    return f * ratio[0], b * ratio[1]


def _plan_ratio(model: str, truth: tuple, guess: tuple, reference: tuple) -> float:
    """Throughput (under the true times) of the plan made from `guess` over the plan made from the truth."""
    from engine.costmodel import score
    from engine.devices import Cluster, Device
    from engine.planners import make_plan
    from engine.planners.common import Problem
    from engine.workloads import workload

    cluster = Cluster(
        tuple(Device(n, "custom", 8.0, 100.0) for n in ("u-0", "u-1", "r-0", "r-1")), name="probe", bandwidth_mbps=1000
    )
    base = workload(model)
    ref = {"r-0": reference, "r-1": reference}
    true_w = base.with_device_times({"u-0": truth, "u-1": truth, **ref})
    guess_w = base.with_device_times({"u-0": guess, "u-1": guess, **ref})
    best = make_plan("asteroid", Problem(true_w, cluster, PLAN_BATCH))
    made = make_plan("asteroid", Problem(guess_w, cluster, PLAN_BATCH))
    return score(made, true_w).throughput / score(best, true_w).throughput


def evaluate(doc: dict, held_out: str, plans: bool = True) -> dict[str, Scores]:
    """Every method's scores on configuration `held_out`, predicted by a predictor fitted without it."""
    predictor = Predictor.fit(doc, exclude=(held_out,))
    measured = doc["configs"][held_out]
    probe = from_measurements({m: v[str(PROBE_BATCH)] for m, v in measured.items()})
    others = [c for c in sorted(doc["configs"]) if c != held_out]
    reference = REFERENCE if REFERENCE in others else others[0]
    scores = {m: Scores([], [], []) for m in (*METHODS, NOISE)}
    probed = {(k.split(":")[0], int(k.split(":")[1])) for k in PROBE_KEYS}
    adapted = DeviceModel.from_probe(probe, predictor)
    halves = {
        "regressor": DeviceModel.from_probe(probe, replace(predictor, columns={}), adapt=False),
        "completion": DeviceModel.from_probe(probe, _CompletionOnly(predictor), adapt=False),
    }
    for model, by_batch in measured.items():
        if model not in doc["configs"][reference]:
            continue
        n = len(by_batch[str(PROBE_BATCH)])
        # Continual: the device trained the middle stage of a 3-stage split of this model and measured its times.
        a, b = round(n / 3), round(2 * n / 3)
        tf, tb = _truth(doc, held_out, model, PROBE_BATCH)
        continual = DeviceModel.from_probe(probe, predictor)
        continual.update(model, a, b, PROBE_BATCH, float(tf[a:b].sum()), float(tb[a:b].sum()))
        for mb in sorted(int(x) for x in by_batch):
            truth = _truth(doc, held_out, model, mb)
            guesses = {
                "flops": _flops(model, probe),
                "scaled": _scaled(doc, reference, model, mb, probe),
                **{name: half.predict(model, mb) for name, half in halves.items()},
                "predictor": DeviceModel.from_probe(probe, predictor, adapt=False).predict(model, mb),
                "adapted": adapted.predict(model, mb),
                "continual": continual.predict(model, mb),
            }
            total = truth[0] + truth[1]
            keep = [i for i in range(n) if mb != PROBE_BATCH or (model, i) not in probed]
            for method, (f, bw) in guesses.items():
                s = scores[method]
                seen = method == "continual" and mb == PROBE_BATCH  # not scored on the stage it measured
                s.layer += (np.abs(f + bw - total) / total)[[i for i in keep if not (seen and a <= i < b)]].tolist()
                ranges = [(i, j) for i, j in _ranges(n) if not (seen and (i, j) == (a, b))]
                s.stage += [abs((f + bw)[i:j].sum() / total[i:j].sum() - 1) for i, j in ranges]
                if plans and mb == PROBE_BATCH:
                    ref = _truth(doc, reference, model, mb)
                    guess = (np.maximum(f, 1e-9), np.maximum(bw, 1e-9))  # FLOPs say 0 s for memory-bound layers
                    s.plan.append(_plan_ratio(model, truth, guess, ref))
        again = doc.get("repeat", {}).get(held_out, {}).get(model, {}).get(str(PROBE_BATCH))
        if again:
            total = np.add(*_truth(doc, held_out, model, PROBE_BATCH))
            repeat = np.asarray(again, dtype=float).sum(axis=1)
            keep = [i for i in range(n) if (model, i) not in probed]
            scores[NOISE].layer += (np.abs(repeat - total) / total)[keep].tolist()
            scores[NOISE].stage += [abs(repeat[i:j].sum() / total[i:j].sum() - 1) for i, j in _ranges(n)]
    return scores


def predictor_bench(doc: dict, configs: list[str] | None = None, plans: bool = True, progress: bool = True) -> dict:
    """{held-out configuration: {method: Scores}} over `configs` (default: every measured one)."""
    configs = configs or sorted(doc["configs"])
    out = {}
    with Progress(len(configs), "leave one configuration out", progress) as bar:
        for c in configs:
            out[c] = evaluate(doc, c, plans)
            bar.update(note=c)
    return out


def _pct(xs: list[float], q: float) -> str:
    return f"{100 * float(np.percentile(xs, q)):.1f} %" if xs else "-"


def report(results: dict[str, dict[str, Scores]], doc: dict, command: str) -> str:
    """Markdown: pooled errors and plan quality per method, then the adapted predictor per held-out configuration."""
    how = "; ".join(
        f"{section}: {m['rounds']} pass(es){', threads pinned' if m.get('pinned') else ''}, median per layer"
        for section, m in sorted(doc.get("method", {}).items())
    )
    lines = [
        f"Measured on: {doc.get('host', '?')}; configurations {', '.join(sorted(doc['configs']))}; "
        f"held out in turn: {', '.join(results)}{f'; measured as {how}' if how else ''}. Command: `{command}`",
        "",
        "| method | per-layer error, median | p90 | stage error, median | p90 | plan throughput vs true-profile plan, "
        "median | worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in (*METHODS, NOISE):
        layer = [e for r in results.values() for e in r[m].layer]
        if not layer:
            continue
        stage = [e for r in results.values() for e in r[m].stage]
        plan = [e for r in results.values() for e in r[m].plan]
        median = f"{100 * np.median(plan):.1f} %" if plan else "-"
        worst = f"{100 * min(plan):.1f} %" if plan else "-"
        errors = f"{_pct(layer, 50)} | {_pct(layer, 90)} | {_pct(stage, 50)} | {_pct(stage, 90)}"
        lines.append(f"| {m} | {errors} | {median} | {worst} |")
    lines += ["", "| held out | " + " | ".join(f"{m} median layer / stage" for m in METHODS) + " |"]
    lines.append("|---" * (len(METHODS) + 1) + "|")
    for c, r in results.items():
        cells = [f"{_pct(r[m].layer, 50)} / {_pct(r[m].stage, 50)}" for m in METHODS]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results: dict[str, dict[str, Scores]], prefix: Path) -> list[Path]:
    """Median and 90th-percentile per-layer and stage errors per method (bars): HTML, and PNG when kaleido can."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["per-layer error", "stage error"])
    shown = [m for m in (*METHODS, NOISE) if any(r[m].layer for r in results.values())]
    for col, attr in ((1, "layer"), (2, "stage")):
        for q, color in ((50, "#1f77b4"), (90, "#ff7f0e")):
            y = [100 * np.percentile([e for r in results.values() for e in getattr(r[m], attr)], q) for m in shown]
            fig.add_trace(go.Bar(name=f"p{q}", x=shown, y=y, marker_color=color, showlegend=col == 1), row=1, col=col)
        fig.update_yaxes(title_text="relative error, %", type="log", row=1, col=col)
    fig.update_layout(
        title="Latency prediction for an unseen configuration (leave one out; lower is better)",
        barmode="group",
        height=480,
        width=1200,
    )
    from engine.bench.render import write_figure

    return write_figure(fig, prefix)
