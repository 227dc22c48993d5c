"""`python -m engine bench spread`: FTPipeHD's setting, one Xavier NX beside boards ten times slower, trained for
real: Asteroid against FTPipeHD's planner and the even pipeline FTPipeHD compared with (layers split evenly by
count, one device per stage: our `gpipe` baseline)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from engine.costmodel import ideal_throughput
from engine.devices import Cluster, Device, get_kind
from engine.errors import UserError
from engine.planners import NoFeasiblePlan, Problem, make_plan
from engine.progress import Progress

SPREAD = 10.0  # the NX's speed over each slow board's
SLOW_BOARDS = 3
MODELS = {"mobilenetv2": 32, "vgg16": 32, "bert-small": 8}
METHODS = {"asteroid": "asteroid", "ftpipehd": "ftpipehd", "even": "gpipe"}  # row label -> planner
ITERATIONS = 4  # the first is left out of the measured throughput (engine.metrics)
PAPER = 6.8  # FTPipeHD over the even pipeline at a 10x spread, as the paper reports


@dataclass
class Run:
    model: str
    batch_size: int
    bandwidth_mbps: float
    method: str  # a key of METHODS
    shape: str = ""
    micro_batches: int = 0
    predicted: float = 0.0  # samples/s at the simulated iteration
    measured: float = 0.0  # samples/s, device time
    ideal: float = 0.0
    wall_s: float = 0.0
    error: str = ""


def spread_cluster(mbps: float = 1000.0, slow_boards: int = SLOW_BOARDS, spread: float = SPREAD) -> Cluster:
    """One Xavier NX and `slow_boards` boards like it but `spread` times slower (same memory)."""
    nx = get_kind("nx")
    slow = [Device(f"slow-{k}", "custom", nx.memory_gb, nx.gflops / spread, nx.reserved_gb) for k in range(slow_boards)]
    return Cluster((Device.of_kind("nx-0", "nx"), *slow), bandwidth_mbps=mbps, name=f"nx+{slow_boards}x(nx/{spread:g})")


def _shape(plan) -> str:
    """e.g. 'nx-0 [0, 7) > slow-0 [7, 21)'."""
    return " > ".join(
        "+".join(s.name for s in st.devices) + f" [{st.start}, {st.end})" for st in plan.stages
    )  # fmt: skip


def run_one(model: str, batch: int, mbps: float, method: str, iterations: int) -> Run:
    """Plan with `method` and train the plan emulated; a failure is recorded, not raised."""
    from engine.runtime.launcher import RunOptions, train
    from engine.workloads import workload

    w = workload(model)
    cluster = spread_cluster(mbps)
    run = Run(model, batch, mbps, method, ideal=ideal_throughput(w, cluster))
    start = time.monotonic()
    try:
        plan = make_plan(METHODS[method], Problem(w, cluster, batch))
        run.shape, run.micro_batches = _shape(plan), plan.micro_batches
        run.predicted = plan.predicted.expected_throughput
        if not plan.predicted.fits:
            run.error = "its best plan does not fit in memory"
            return run
        result = train(plan, w, RunOptions(iterations=iterations, emulate=True))
        run.measured = result.throughput
    except (NoFeasiblePlan, UserError) as exc:
        run.error = str(exc)
    run.wall_s = time.monotonic() - start
    return run


def spread_bench(models: dict[str, int], bandwidths: tuple[float, ...], iterations: int = ITERATIONS) -> list[Run]:
    cells = [(m, b, bw) for m, b in models.items() for bw in bandwidths]
    runs = []
    with Progress(len(cells) * len(METHODS), "spread", sys.stderr.isatty()) as bar:
        for model, batch, mbps in cells:
            for method in METHODS:
                bar.update(0, f"{model} {mbps:g} Mbps {method}")
                runs.append(run_one(model, batch, mbps, method, iterations))
                bar.update(1)
    return runs


def _ratio(a: Run | None, b: Run | None) -> str:
    return f"{a.measured / b.measured:.2f}x" if a and b and a.measured and b.measured else "n/a"


def report(runs: list[Run], command: str, iterations: int = ITERATIONS) -> str:
    cluster = spread_cluster()
    lines = [
        "## FTPipeHD's spread: one fast board beside slow ones",
        "",
        f"Command: `{command}`. Cluster: {cluster.devices[0].name} (Jetson Xavier NX) and {len(cluster.devices) - 1} "
        f"boards like it but {SPREAD:g}x slower ({cluster.devices[1].gflops:g} of its {cluster.devices[0].gflops:g} "
        f"GFLOPS FP16 peak, same memory), emulated on this host (time dilation), {iterations} iterations per run, the "
        "first left out. *even* = layers split evenly by count, one device per stage (what FTPipeHD compared with; "
        "our `gpipe` baseline). Samples/s are device time; ideal = every device alone with the whole model.",
        "",
        "| model (batch) | Mbps | method | plan | M | predicted | measured | measured / predicted | of ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.error:
            lines.append(
                f"| {r.model} ({r.batch_size}) | {r.bandwidth_mbps:g} | {r.method} | {r.shape or '-'} | "
                f"{r.micro_batches or '-'} | {r.predicted:.1f} | failed: {r.error} | | |"
            )
            continue
        lines.append(
            f"| {r.model} ({r.batch_size}) | {r.bandwidth_mbps:g} | {r.method} | {r.shape} | {r.micro_batches} | "
            f"{r.predicted:.1f} | {r.measured:.1f} | {r.measured / r.predicted:.2f} | {r.measured / r.ideal:.0%} |"
        )
    lines += [
        "",
        f"Measured speedups (the paper reports {PAPER:g}x for FTPipeHD over the even pipeline at this spread):",
        "",
        "| model | Mbps | FTPipeHD / even | Asteroid / FTPipeHD | Asteroid / even |",
        "|---|---|---|---|---|",
    ]
    cells: dict[tuple, dict[str, Run]] = {}
    for r in runs:
        cells.setdefault((r.model, r.bandwidth_mbps), {})[r.method] = r
    for (model, mbps), got in cells.items():
        ours, ft, even = got.get("asteroid"), got.get("ftpipehd"), got.get("even")
        lines.append(f"| {model} | {mbps:g} | {_ratio(ft, even)} | {_ratio(ours, ft)} | {_ratio(ours, even)} |")
    return "\n".join([*lines, ""])
