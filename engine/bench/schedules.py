"""`python -m engine bench schedule`: 1F1B against the zero-bubble schedules, simulated and trained, per cell.

Per cell (a model at a batch on a cluster), Asteroid plans twice: held to 1F1B (as it planned before the
zero-bubble schedules) and free to pick the schedule (the default). The chosen plan then runs under each
schedule, simulated (engine.simulator) and trained on the emulated cluster (one process per device, time
dilation), so the schedules are compared on one plan; the 1F1B-only plan is trained too where its shape differs.
Measured: the iteration (engine.metrics), the bubble of the last iteration (the share of the plan's devices'
time not spent in F, B or W) and each device's peak memory; the fraction of the ideal is the measured
throughput over every device's own throughput with the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.costmodel import ideal_throughput, score
from engine.devices import CLUSTERS
from engine.planners import Problem, make_plan
from engine.progress import Progress
from engine.schedule import SCHEDULES
from engine.simulator import simulate

# Two model families (CNNs, transformers) at batches where the pipeline, not the batch, limits the fraction of the
# ideal (VGG-16 at 64 is held near 0.65 by its batch, at 128 it simulates 0.71 on B and C).
MODELS = {"mobilenetv2": 128, "gpt-small": 32, "vgg16": 128, "bert-small": 32}
DEFAULT_MODELS = ("mobilenetv2", "gpt-small")
ITERATIONS = 4  # trained per run; the first is left out of the measured iteration


@dataclass(frozen=True)
class ScheduleRun:
    """One plan under one schedule: simulated and, where trained, measured."""

    model: str
    cluster: str
    batch_size: int
    plan: str  # "chosen" (Asteroid's pick), or "1f1b only" (Asteroid held to 1F1B)
    shape: str
    schedule: str
    simulated_s: float
    simulated_bubble: float
    predicted_memory: float  # the fullest device's predicted bytes over its memory
    ideal: float  # samples/s
    measured_s: float | None = None
    measured_bubble: float | None = None
    measured_memory: float | None = None  # the fullest device's measured peak over its memory
    late_steps: int = 0
    steps: int = 0

    @property
    def of_ideal(self) -> float | None:
        return self.batch_size / self.measured_s / self.ideal if self.measured_s else None


def measured_bubble(events, devices: list[str], iteration: int, iteration_s: float) -> float:
    """The share of the devices' time in `iteration` not spent computing (F, B, W), as the simulator counts it."""
    busy = sum(e.end - e.start for e in events if e.iteration == iteration and e.kind in ("F", "B", "W"))
    return 1 - busy / (len(devices) * iteration_s)


def _run(plan, w, label: str, iterations: int, train_it: bool) -> ScheduleRun:
    from engine.bench.reproduce import _shape

    cluster = plan.cluster
    shape = _shape(plan.with_schedule("1f1b"))  # the schedule has its own column
    sim = simulate(plan, w)
    fullest = max(b / cluster.device(n).memory_bytes for n, b in sim.memory_bytes.items())
    run = dict(
        model=plan.model, cluster=cluster.name, batch_size=plan.batch_size, plan=label, shape=shape,
        schedule=plan.schedule, simulated_s=sim.iteration_s, simulated_bubble=sim.bubble_fraction,
        predicted_memory=fullest, ideal=ideal_throughput(w, cluster),
    )  # fmt: skip
    if train_it:
        from engine.runtime.launcher import RunOptions, train

        result = train(plan, w, RunOptions(iterations=iterations, emulate=True))
        last = result.iterations[-1]
        peaks = [
            d.get("peak_memory_bytes", 0) / cluster.device(n).memory_bytes
            for n, d in result.devices.items()
            if n in plan.device_names
        ]
        run.update(
            measured_s=result.measured_iteration_s,
            measured_bubble=measured_bubble(result.events, plan.device_names, last["iteration"], last["iteration_s"]),
            measured_memory=max(peaks, default=None),
            late_steps=result.late_steps,
            steps=result.steps,
        )
    return ScheduleRun(**run)


def schedule_bench(
    models: dict[str, int], clusters: str, mbps: float, iterations: int = ITERATIONS, train_it: bool = True,
    progress: bool = False,
) -> list[ScheduleRun]:  # fmt: skip
    """Every model on every cluster letter at `mbps`: the chosen plan under each schedule, then the 1F1B-only
    plan where its shape differs."""
    from engine.workloads import workload

    cells = [(m, b, c) for m, b in models.items() for c in clusters]
    out: list[ScheduleRun] = []
    with Progress(len(cells) * (len(SCHEDULES) + 1), "schedules", progress) as bar:
        for model, batch, letter in cells:
            cluster = CLUSTERS[letter].with_bandwidth(mbps)
            w = workload(model)
            chosen = make_plan("asteroid", Problem(w, cluster, batch))
            only = make_plan("asteroid", Problem(w, cluster, batch, schedule="1f1b"))
            for name in SCHEDULES:
                bar.update(0, f"{model} on {letter}: {name}")
                plan = chosen.with_schedule(name)
                plan = plan.with_prediction(score(plan, w))
                if plan.predicted.fits:
                    out.append(_run(plan, w, "chosen" + " (picked)" * (name == chosen.schedule), iterations, train_it))
                bar.update(1)
            if (only.micro_batches, only.stages) != (chosen.micro_batches, chosen.stages):
                out.append(_run(only, w, "1f1b only", iterations, train_it))
            bar.update(1)
    return out


def report(rows: list[ScheduleRun], command: str, mbps: float, iterations: int) -> str:
    lines = [
        f"## Schedules: 1F1B against zero-bubble ({mbps:g} Mbps)",
        "",
        f"Command: `{command}`. Each cell: Asteroid's chosen plan under every schedule, and the plan Asteroid makes "
        f"when held to 1F1B where it differs; simulated, and trained for {iterations} iterations on the emulated "
        "cluster (the first left out). `bubble`: the share of the plan's devices' time not in F, B or W (the "
        "measured one from the last iteration); `memory`: the fullest device, predicted and measured peak, over its "
        "memory; `of ideal`: simulated and measured throughput over every device's own throughput.",
        "",
        "| model | cluster | batch | plan | shape | schedule | simulated s | sim. bubble | measured s | meas. bubble "
        "| memory pred. / meas. | of ideal sim. / meas. | vs 1F1B (measured) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r.model, r.cluster, r.batch_size): r for r in rows if r.schedule == "1f1b" and r.plan.startswith("chosen")}
    for r in rows:
        ref = base.get((r.model, r.cluster, r.batch_size))
        gain = f"{ref.measured_s / r.measured_s:.2f}x" if ref and ref.measured_s and r.measured_s else ""
        measured = f"{r.measured_s:.4f}" if r.measured_s else "not trained"
        if r.late_steps:
            measured += f" ({r.late_steps}/{r.steps} steps late)"
        bubble = f"{100 * r.measured_bubble:.0f}%" if r.measured_bubble is not None else ""
        memory = f"{100 * r.measured_memory:.1f}%" if r.measured_memory is not None else "-"
        ideal = f"{r.batch_size / r.simulated_s / r.ideal:.2f} / " + (f"{r.of_ideal:.2f}" if r.of_ideal else "-")
        lines.append(
            f"| {r.model} | {r.cluster} | {r.batch_size} | {r.plan} | {r.shape} | {r.schedule} | {r.simulated_s:.4f} | "
            f"{100 * r.simulated_bubble:.0f}% | {measured} | {bubble} | {100 * r.predicted_memory:.1f}% / {memory} | "
            f"{ideal} | {gain} |"
        )
    return "\n".join(lines) + "\n"
