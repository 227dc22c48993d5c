"""`python -m engine bench planner`: planning time by cluster and model size, and every method's predicted
throughput on clusters A-D for each model, as a markdown report."""

from __future__ import annotations

import multiprocessing as mp
import platform
import random
import statistics
import sys
import time
from dataclasses import replace

from engine.costmodel import Workload, ideal_throughput
from engine.devices import CLUSTERS, Cluster, Device
from engine.plan import Plan
from engine.planners import COMPARED, NoFeasiblePlan, Problem, kernel, make_plan
from engine.planners.asteroid import EXACT_LIMIT, search_size
from engine.planners.common import device_classes
from engine.progress import Progress

DEVICES = (4, 8, 16, 32, 64, 128)
ZOO_DEVICES = (64, 128)  # the zoo's models planned on these synthetic clusters
LAYERS = (20, 50, 100, 200)
MODELS = {"mobilenetv2": 128, "resnet50": 64, "vgg16": 128, "bert-small": 32, "gpt-small": 32}
TIMING_BATCH = 256
REPLAN_MODELS = {"mobilenetv2": 128, "resnet50": 64, "gpt-small": 32}
REPEATS = 3  # each re-plan timed this many times, the median reported
BANDWIDTHS = (1000.0, 100.0)
QUICK = {"devices": (4, 8), "layers": (20, 50), "models": {"mobilenetv2": 128}}


def synthetic_workload(layers: int, seed: int = 0) -> Workload:
    """A CNN-like workload: compute and activations vary layer to layer, parameters grow with depth."""
    rng = random.Random(seed)
    fwd = [rng.uniform(5e6, 60e6) for _ in range(layers)]
    return Workload(
        model=f"synthetic-{layers}",
        forward_flops=tuple(fwd),
        backward_flops=tuple(2 * f for f in fwd),
        output_bytes=tuple(int(rng.uniform(8e3, 130e3) * (1 - 0.8 * k / layers)) for k in range(layers)),
        saved_bytes=tuple(int(rng.uniform(16e3, 260e3)) for _ in range(layers)),
        peak_bytes=tuple(int(rng.uniform(16e3, 130e3)) for _ in range(layers)),
        param_bytes=tuple(int(rng.uniform(0.2e6, 4e6) * (0.2 + 1.6 * k / layers)) for k in range(layers)),
        optimizer_bytes=tuple(0 for _ in range(layers)),
    )


def synthetic_cluster(devices: int) -> Cluster:
    """NX, TX2 and Nano boards in turn."""
    kinds = ("nx", "tx2", "nano")
    return Cluster(tuple(Device.of_kind(f"{kinds[k % 3]}-{k}", kinds[k % 3]) for k in range(devices)), name="synthetic")


def _time_cell(devices: int, layers: int | str, exact_limit: int, rank: bool, out) -> None:
    from engine.planners import asteroid
    from engine.workloads import workload

    asteroid.EXACT_LIMIT = exact_limit  # this child process only
    w = workload(layers) if isinstance(layers, str) else synthetic_workload(layers)
    problem = Problem(w, synthetic_cluster(devices), TIMING_BATCH, rank=rank)
    start = time.perf_counter()
    plan = make_plan("asteroid", problem)
    out.put((time.perf_counter() - start, len(plan.stages), plan.micro_batches, plan.predicted.iteration_s))


def time_planning(
    devices: int, layers: int | str, timeout: float, exact_limit: int = EXACT_LIMIT, rank: bool = True
) -> tuple[float, int, int, float] | None:
    """(seconds, stages, micro-batches, closed-form iteration s) of planning, in a child process, the synthetic
    workload of `layers` layers (or the zoo model of that name) at TIMING_BATCH on `devices` synthetic boards
    (`rank`: the whole planner; False: its closed-form search alone), or None past `timeout`."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_time_cell, args=(devices, layers, exact_limit, rank, out))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return out.get() if not out.empty() else None


def planner_bench(quick: bool = False, timeout: float = 60.0) -> str:
    devices = QUICK["devices"] if quick else DEVICES
    layers = QUICK["layers"] if quick else LAYERS
    models = QUICK["models"] if quick else MODELS
    command = "python -m engine bench planner" + (" --quick" if quick else "") + f" --timeout {timeout:g}"
    lines = [
        "## Planner",
        "",
        f"Command: `{command}` (on {platform.machine()}, Python {platform.python_version()}, one process per cell).",
        "",
        f"### Planning time (Asteroid, synthetic CNN-like workload, batch {TIMING_BATCH}, NX/TX2/Nano in turn)",
        "",
        "Search: *exact* over every assignment of devices to stages while the cluster's "
        f"(remaining, group) count-vector pairs stay <= {EXACT_LIMIT}; past that, *ordered*: stage groups are "
        "contiguous runs of the memory order (the published planner's space). Cells over the time limit say so. "
        "Times are of a process with the compiled search loaded (a new process loads it in about 0.3 s; the first "
        "plan after installing compiles it, about 10 s, which `make venv` does).",
        "",
        "| devices | search | " + " | ".join(f"{n} layers" for n in layers) + " |",
        "|---|---|" + "---|" * len(layers),
    ]
    boundary = exact_boundary()
    rows = sorted({*devices, boundary})
    kernel.warm()  # every cell's process forks from this one, with the compiled search loaded
    with Progress(len(rows) * len(layers), "planning time", sys.stderr.isatty()) as bar:
        for n in rows:
            mode = "exact" if search_size(synthetic_cluster(n)) <= EXACT_LIMIT else "ordered"
            cells = []
            for n_layers in layers:
                res = time_planning(n, n_layers, timeout)
                cells.append(f"> {timeout:g} s" if res is None else f"{res[0]:.2f} s ({res[1]} st, M={res[2]})")
                bar.update(note=f"{n} devices x {n_layers} layers")
            lines.append(f"| {n} | {mode} | " + " | ".join(cells) + " |")
    kinds = "/".join(str(len(c)) for c in device_classes(synthetic_cluster(boundary)))
    lines += [
        "",
        "`st` = stages of the plan found, `M` = micro-batches.",
        "",
        f"Exact/ordered boundary: exact search up to {boundary} devices ({kinds} NX/TX2/Nano, search size "
        f"{search_size(synthetic_cluster(boundary))} <= {EXACT_LIMIT}); ordered from {boundary + 1}.",
        "",
    ]
    lines += zoo_table(ZOO_DEVICES[:1] if quick else ZOO_DEVICES, models, timeout)
    lines += exact_vs_ordered(devices, layers, timeout)
    lines += replan_table(QUICK["models"] if quick else REPLAN_MODELS, (20,) if quick else (20, 50))
    for mbps in BANDWIDTHS:
        lines += throughput_table(models, mbps) + [""]
    return "\n".join(lines)


def zoo_table(devices: tuple[int, ...], models: dict[str, int], timeout: float) -> list[str]:
    """The zoo's models (each cut only where the model may be cut) on large synthetic clusters."""
    from engine.workloads import workload

    lines = [
        f"### Planning time of the zoo's models on large clusters (batch {TIMING_BATCH}, NX/TX2/Nano in turn)",
        "",
        "The whole planner, as the synthetic cells above, for the zoo's models (their layers: where each may be cut).",
        "",
        "| model (layers) | " + " | ".join(f"{n} devices" for n in devices) + " |",
        "|---|" + "---|" * len(devices),
    ]
    with Progress(len(devices) * len(models), "planning time, zoo models", sys.stderr.isatty()) as bar:
        for name in models:
            cells = []
            for n in devices:
                res = time_planning(n, name, timeout)
                cells.append(f"> {timeout:g} s" if res is None else f"{res[0]:.2f} s ({res[1]} st, M={res[2]})")
                bar.update(note=f"{name} on {n} devices")
            lines.append(f"| {name} ({workload(name).num_layers}) | " + " | ".join(cells) + " |")
    return [*lines, ""]


def exact_boundary() -> int:
    """The most synthetic devices (NX, TX2, Nano in turn) that Asteroid still plans with the exact search."""
    n = 1
    while search_size(synthetic_cluster(n + 1)) <= EXACT_LIMIT:
        n += 1
    return n


def exact_vs_ordered(devices: tuple[int, ...], layers: tuple[int, ...], timeout: float) -> list[str]:
    """What the exact search buys over the published (ordered) space, where the exact one runs."""
    sizes = [n for n in devices if search_size(synthetic_cluster(n)) <= EXACT_LIMIT]
    if not sizes:
        return []
    lines = [
        "### Exact search against the published planner's space",
        "",
        "The same cells planned again with groups restricted to contiguous runs of the memory order, by the "
        "closed-form search alone (no ranking by simulation, so the two spaces are compared on one objective). "
        "`gain` = how much longer the ordered plan's closed-form iteration is.",
        "",
        "| devices | layers | exact: time, iteration | ordered: time, iteration | gain |",
        "|---|---|---|---|---|",
    ]
    for n in sizes:
        for n_layers in layers:
            exact = time_planning(n, n_layers, timeout, rank=False)
            ordered = time_planning(n, n_layers, timeout, exact_limit=0, rank=False)
            if exact is None or ordered is None:
                continue
            lines.append(
                f"| {n} | {n_layers} | {exact[0]:.2f} s, {exact[3]:.4f} s | {ordered[0]:.2f} s, {ordered[3]:.4f} s | "
                f"{100 * (ordered[3] / exact[3] - 1):.1f} % |"
            )
    return [*lines, ""]


def replan_table(models: dict[str, int], synthetic_layers: tuple[int, ...]) -> list[str]:
    """What a recovery or a membership change waits for: the whole Asteroid planner (ranking included, as the
    coordinator calls it) on each cluster A-D less each of its devices (a loss or a leave) and plus one device of
    its first kind (a join), and on the largest synthetic cluster of the exact search and on the synthetic 64-device
    cluster less one device."""
    from engine.workloads import workload

    lines = [
        "### Re-planning time",
        "",
        "The whole planner, as the coordinator runs it after a loss, a leave or a join (told the plan before the "
        "change), in one process with the compiled search loaded; each figure the median of 3 runs. *Less one*: "
        "each device of the cluster removed in turn (median and slowest of them); *plus one*: a device of the "
        "cluster's first kind added.",
        "",
        "| cluster | model (batch) | less one: median | less one: slowest | plus one |",
        "|---|---|---|---|---|",
    ]
    cells = [(letter, cluster, name, batch) for name, batch in models.items() for letter, cluster in CLUSTERS.items()]
    cells += [  # the largest cluster of the exact search, and one of the ordered search
        (f"{n} synthetic", synthetic_cluster(n), layers, TIMING_BATCH) for n in (exact_boundary(), 64)
        for layers in synthetic_layers
    ]  # fmt: skip
    with Progress(len(cells), "re-planning time", sys.stderr.isatty()) as bar:
        for label, cluster, name, batch in cells:
            w = synthetic_workload(name) if isinstance(name, int) else workload(name)
            before = make_plan("asteroid", Problem(w, cluster, batch))  # the plan the change replaces
            less = [_plan_seconds(w, replace(cluster, devices=tuple(x for x in cluster.devices if x != d)), batch,
                                  before) for d in cluster.devices[:8]]  # fmt: skip
            extra = Device.of_kind("joined-0", cluster.devices[0].kind)
            plus = _plan_seconds(w, replace(cluster, devices=(*cluster.devices, extra)), batch, before)
            model = f"synthetic, {name} layers" if isinstance(name, int) else f"{name} ({batch})"
            lines.append(f"| {label} | {model} | {statistics.median(less):.3f} s | {max(less):.3f} s | {plus:.3f} s |")
            bar.update(note=f"{label} {model}")
    return [*lines, "", "The synthetic rows remove the first 8 devices in turn (NX, TX2 and Nano).", ""]


def _plan_seconds(w: Workload, cluster: Cluster, batch: int, previous: Plan) -> float:
    """The median of REPEATS re-plans' seconds (this host's noise is a good part of a 0.1 s figure)."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        try:
            make_plan("asteroid", Problem(w, cluster, batch, previous=previous))
        except NoFeasiblePlan:
            pass  # the time to find that nothing fits is still the re-plan's time
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput_table(models: dict[str, int], bandwidth_mbps: float) -> list[str]:
    """Predicted (simulated) samples/s of every method per cluster and model, with the ideal and Asteroid's
    speedups."""
    from engine.workloads import workload

    lines = [
        f"### Predicted throughput (samples/s) on clusters A-D, {bandwidth_mbps:g} Mbps",
        "",
        "Each plan's simulated iteration (engine.simulator; `predicted.simulated_s`). "
        "Ideal = the sum of every device's own throughput with the whole model and no communication. "
        "Speedups are Asteroid over data parallelism (dp) and over the best other pipeline planner "
        "(gpipe, pipedream, ftpipehd). `OOM`: the method's best plan does not fit in memory.",
        "",
        "| cluster | model (batch) | ideal | asteroid | dp | gpipe | pipedream | ftpipehd | vs dp | vs best pipeline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    best_dp = best_pipe = (0.0, "")
    for name, batch in models.items():
        w = workload(name)
        for letter, cluster in CLUSTERS.items():
            problem = Problem(w, cluster.with_bandwidth(bandwidth_mbps), batch)
            got: dict[str, float | None] = {}
            cells = []
            for method in COMPARED:
                try:
                    plan = make_plan(method, problem)
                    fits = plan.predicted.fits
                    got[method] = plan.predicted.expected_throughput if fits else None
                    cells.append(f"{plan.predicted.expected_throughput:.1f}" if fits else "OOM")
                except NoFeasiblePlan:
                    got[method] = None
                    cells.append("none")
            ours = got["asteroid"]
            pipes = [v for m, v in got.items() if m in ("gpipe", "pipedream", "ftpipehd") and v]
            vs_dp = ours / got["dp"] if ours and got["dp"] else None
            vs_pipe = ours / max(pipes) if ours and pipes else None
            if vs_dp and vs_dp > best_dp[0]:
                best_dp = (vs_dp, f"{name} on {letter}")
            if vs_pipe and vs_pipe > best_pipe[0]:
                best_pipe = (vs_pipe, f"{name} on {letter}")
            fmt = lambda v: f"{v:.2f}x" if v else "n/a"  # noqa: E731
            lines.append(
                f"| {letter} | {name} ({batch}) | {ideal_throughput(w, cluster):.1f} | "
                + " | ".join(cells)
                + f" | {fmt(vs_dp)} | {fmt(vs_pipe)} |"
            )
    lines += [
        "",
        f"Largest predicted speedup over data parallelism: {best_dp[0]:.2f}x ({best_dp[1]}); "
        f"over the best other pipeline planner: {best_pipe[0]:.2f}x ({best_pipe[1]}).",
    ]
    return lines
