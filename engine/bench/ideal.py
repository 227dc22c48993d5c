"""`python -m engine bench ideal`: where the device time of Asteroid's plans goes, against the ideal, by batch size.

The ideal is the sum of every device's own throughput with the whole model and no communication. Each cell plans
with Asteroid and simulates one iteration (engine.simulator, which the measured runs of `bench reproduce` match
within a few per cent), then splits all devices' time into the samples' own compute, per-layer launch overhead,
stage all-reduces (their part after a device's last step), devices the plan leaves out, and waiting (fill and
drain, imbalance, links).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.costmodel import Workload, ideal_throughput
from engine.devices import CLUSTERS, LAYER_OVERHEAD_S, Cluster
from engine.planners import Problem, make_plan
from engine.progress import Progress
from engine.simulator import simulate
from engine.steps import device_steps

MULTIPLES = (1, 4, 16)  # batch sizes: the reproduction's, and 4x and 16x it


@dataclass(frozen=True)
class Breakdown:
    """One cell: Asteroid's simulated fraction of the ideal and each share of all devices' time."""

    model: str
    cluster: str
    batch_size: int
    shape: str
    of_ideal: float
    compute: float
    overhead: float
    allreduce: float
    unused: float

    @property
    def waiting(self) -> float:
        return 1 - self.compute - self.overhead - self.allreduce - self.unused


def breakdown(w: Workload, cluster: Cluster, batch: int) -> Breakdown:
    """Asteroid's plan for `w` on `cluster` at `batch`, simulated, and where every device's time goes."""
    from engine.bench.reproduce import _shape

    plan = make_plan("asteroid", Problem(w, cluster, batch))
    sim = simulate(plan, w)
    total = sim.iteration_s * len(cluster.devices)  # every device's time, the idle ones too
    compute = overhead = allreduce = 0.0
    for name, s in device_steps(plan, w).items():
        st = plan.stages[s.stage]
        compute += plan.micro_batches * s.samples * w.compute_s(cluster.device(name), st.start, st.end)
        overhead += plan.micro_batches * 2 * (st.end - st.start) * LAYER_OVERHEAD_S
        # the all-reduce's part that runs after the device's last step (the rest is under its last backward)
        mine = [e for e in sim.events if e.device == name]
        steps_end = max(e.end for e in mine if e.kind in ("F", "B", "W"))
        allreduce += max([e.end - steps_end for e in mine if e.kind == "all-reduce"] + [0.0])
    unused = 1 - len(plan.device_names) / len(cluster.devices)
    of_ideal = plan.batch_size / plan.predicted.simulated_s / ideal_throughput(w, cluster)
    return Breakdown(w.model, cluster.name, batch, _shape(plan), of_ideal, compute / total, overhead / total,
                     allreduce / total, unused)  # fmt: skip


def ideal_bench(models: dict[str, int], clusters: str, mbps: float, progress: bool = False) -> list[Breakdown]:
    """Every model (at its batch and MULTIPLES of it) on every cluster letter, at `mbps`."""
    from engine.workloads import workload

    cells = [(m, c, b * k) for m, b in models.items() for c in clusters for k in MULTIPLES]
    out = []
    with Progress(len(cells), "simulating", progress) as bar:
        for model, letter, batch in cells:
            out.append(breakdown(workload(model), CLUSTERS[letter].with_bandwidth(mbps), batch))
            bar.update(note=f"{model} on {letter}, batch {batch}")
    return out


def report(rows: list[Breakdown], command: str, mbps: float) -> str:
    lines = [
        f"## Fraction of the ideal: where the device time goes ({mbps:g} Mbps)",
        "",
        f"Command: `{command}`. Asteroid's plan per cell, one simulated iteration; `of ideal` = its throughput over "
        "the sum of every device's own throughput; the rest are shares of all devices' time.",
        "",
        "| model | cluster | batch | plan | of ideal | samples' compute | per-layer overhead | all-reduce | "
        "devices left out | waiting |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.cluster} | {r.batch_size} | {r.shape} | {r.of_ideal:.2f} | {r.compute:.2f} | "
            f"{r.overhead:.2f} | {r.allreduce:.2f} | {r.unused:.2f} | {r.waiting:.2f} |"
        )
    return "\n".join(lines) + "\n"
