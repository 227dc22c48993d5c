"""`python -m engine bench usermodels`: a lab's own models, from the graph capture to a trained run.

Per model (a module file's function or a Hugging Face folder, at a batch): how long capturing and cutting its
graph takes (the first build in the process), the chain it gives (layers, the most tensors one cut carries),
then per cluster how long Asteroid plans it and what it predicts; trained (unless --quick) on the emulated
cluster C: measured against predicted, in device time (time dilation replays the profiles: emulated).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.devices import CLUSTERS
from engine.planners import Problem, make_plan
from engine.progress import Progress

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELS = {
    f"{EXAMPLES}/lab_models.py:resnet18_gn@image:3,32,32": 64,
    f"{EXAMPLES}/lab_models.py:small_unet@image:3,32,32": 64,
    f"hf:{EXAMPLES}/gpt2-tiny@text:128": 16,
}
ITERATIONS = 4  # trained per run; the first is left out of the measured throughput


@dataclass(frozen=True)
class Row:
    model: str
    layers: int
    widest_cut: int  # the most tensors one cut carries
    capture_s: float
    cluster: str
    batch_size: int
    plan_s: float
    predicted: float  # samples/s
    measured: float | None = None  # samples/s, emulated


def usermodels_bench(models: dict[str, int], clusters: str, trained: bool, iterations: int) -> list[Row]:
    from engine.models import get_model
    from engine.runtime.launcher import RunOptions, train
    from engine.workloads import workload

    rows = []
    with Progress(len(models) * len(clusters), "bench usermodels", sys.stderr.isatty()) as bar:
        for ref, batch in models.items():
            started = time.perf_counter()
            spec = get_model(ref)
            capture_s = time.perf_counter() - started
            w = workload(ref)  # profiled once, cached by the file's hash
            widest = max((len(c) for c in spec.chain.cuts), default=1)
            for c in clusters:
                started = time.perf_counter()
                plan = make_plan("asteroid", Problem(w, CLUSTERS[c], batch))
                plan_s = time.perf_counter() - started
                measured = None
                if trained and c == "C":
                    measured = train(plan, w, RunOptions(iterations=iterations, emulate=True)).throughput
                rows.append(Row(_short(ref), len(spec.chain.spans), widest, capture_s, c, batch, plan_s,
                                plan.predicted.expected_throughput, measured))  # fmt: skip
                bar.update(note=f"{_short(ref)} on {c}")
    return rows


def _short(ref: str) -> str:
    return ref.replace(f"{EXAMPLES}/", "examples/").split("#")[0]


def report(rows: list[Row], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| model | layers | widest cut | capture s | cluster | batch | plan s | predicted samples/s | measured "
        "(emulated) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = f"{r.measured:.1f} ({r.measured / r.predicted:.2f}x)" if r.measured else "–"
        lines.append(
            f"| {r.model} | {r.layers} | {r.widest_cut} | {r.capture_s:.2f} | {r.cluster} | {r.batch_size} | "
            f"{r.plan_s:.2f} | {r.predicted:.1f} | {measured} |"
        )
    return "\n".join(lines)
