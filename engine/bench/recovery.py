"""`python -m engine bench recovery`: Asteroid's recovery from lost devices against a checkpoint restart."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.devices import load_cluster

BATCH = 32
ITERATIONS = 8
FAIL_AT = 5  # 1-based: the iteration during which the devices die
QUICK_MODELS = ("mobilenetv2", "gpt-small")
MODELS = ("mobilenetv2", "gpt-small", "resnet50")
SCENARIOS = ("one", "nx", "two")  # one device; the NX of C (the only one of its kind); two at once


@dataclass
class Cell:
    cluster: str
    model: str
    bandwidth_mbps: float
    scenario: str
    failed: tuple[str, ...]
    fail_at: int  # 1-based
    iterations: int
    batch_size: int = BATCH


@dataclass
class Ours:
    real_s: float
    detection_real_s: float
    planning_real_s: float
    setup_real_s: float
    device_s: float
    restore_device_s: float
    replay_device_s: float
    iterations_lost: int
    throughput_before: float
    throughput_after: float  # samples/s: median iteration after the recovery, final generation
    replicate_every: int
    dilation: float | None
    points: list[tuple[float, float, int]] = field(default_factory=list)  # (device time, throughput, generation)
    failure_time: float = 0.0  # device time at which the interrupted iteration began

    @property
    def overhead_real_s(self) -> float:
        """Detection + planning + set-up: the real seconds of the recovery outside emulated device time."""
        return self.detection_real_s + self.planning_real_s + self.setup_real_s


@dataclass
class Restart:
    checkpoint_every: int
    checkpoint_iteration: int  # the checkpoint the restart loads (0: none, from the start)
    detection_real_s: float  # ours (the same detector)
    startup_real_s: float  # checkpoint load + planning + processes until every device is ready
    restore_device_s: float
    retrain_device_s: float
    retrained: int  # iterations re-trained

    @property
    def real_s(self) -> float:
        return self.detection_real_s + self.startup_real_s

    @property
    def device_s(self) -> float:
        return self.restore_device_s + self.retrain_device_s

    @property
    def mid_period_device_s(self) -> float:
        """Derived, not measured: the re-training a failure halfway through a checkpoint period costs (C / 2
        iterations at the measured re-trained iteration time), plus the measured restore."""
        per = self.retrain_device_s / self.retrained if self.retrained else 0.0
        return self.restore_device_s + self.checkpoint_every / 2 * per


@dataclass
class Result:
    cell: Cell
    status: str  # ok, or why not
    ours: Ours | None = None
    restart: Restart | None = None
    fresh_predicted: float | None = None  # samples/s of a fresh plan on the survivors (cost model)
    fresh_measured: float | None = None  # samples/s of a short fresh run on the survivors
    survivors_shape: str = ""

    @property
    def real_ratio(self) -> float | None:
        if self.ours and self.restart and self.ours.overhead_real_s > 0:
            return self.restart.real_s / self.ours.overhead_real_s
        return None

    @property
    def device_ratio(self) -> float | None:
        if self.ours and self.restart and self.ours.device_s > 0:
            return self.restart.device_s / self.ours.device_s
        return None

    @property
    def of_fresh(self) -> float | None:
        """Throughput after the recovery / a fresh plan's (measured when there is one, else predicted)."""
        fresh = self.fresh_measured or self.fresh_predicted
        return self.ours.throughput_after / fresh if self.ours and fresh else None


def victims(letter: str, scenario: str) -> tuple[str, ...] | None:
    """The devices a scenario kills on a cluster (None: the scenario does not apply)."""
    names = [d.name for d in load_cluster(letter, 1000).devices]
    if scenario == "one":
        return ("tx2-1",) if "tx2-1" in names else (names[1],)
    if scenario == "nx":
        nx = [n for n in names if n.startswith("nx-")]
        return (nx[0],) if len(nx) == 1 else None
    if scenario == "two":
        return tuple(names[1:3])
    raise ValueError(scenario)


def _median_throughput(iterations: list[dict], batch: int) -> float:
    return batch / statistics.median(it["iteration_s"] for it in iterations) if iterations else 0.0


def run_cell(cell: Cell, fresh_iterations: int = 3) -> Result:
    """One cell, measured for real.

    Every cell trains one model on one emulated cluster, kills devices mid-iteration (a real SIGKILL) and measures:

    - ours: the coordinator's own `recovered` report (detection, planning and set-up in real seconds; restore and
      replayed iterations in device seconds), and the throughput after the recovery against a fresh plan on the same
      survivors (the cost model's prediction, and a short fresh run on them when `fresh_iterations` > 0);
    - the restart baseline (what torchelastic does): a fault-free run up to the failure writes a checkpoint every C
      iterations (C = our replication period, so both pay for the same copies); then everything restarts on the
      survivors with a fresh plan, loads the last checkpoint and re-trains up to and including the interrupted
      iteration. Its detection is taken to be ours (the same heartbeat detector); its start-up is measured (the
      checkpoint load, planning, and process start until every device reported ready), its device seconds are the
      restore from the checkpoint and the re-trained iterations, all measured.

    Real and device seconds are never added together: the ratio baseline / ours is given for each separately.
    """
    from engine.costmodel import score
    from engine.planners import NoFeasiblePlan, Problem, make_plan
    from engine.runtime.coordinator import RunFailed, load_resume
    from engine.runtime.faults import Fail, Faults
    from engine.runtime.launcher import RunOptions, train
    from engine.workloads import workload

    w = workload(cell.model)
    cluster = load_cluster(cell.cluster, cell.bandwidth_mbps)
    try:
        plan = make_plan("asteroid", Problem(w, cluster, cell.batch_size))
    except NoFeasiblePlan as exc:
        return Result(cell, f"no plan: {exc}")
    survivors = cluster.__class__(
        tuple(d for d in cluster.devices if d.name not in cell.failed),
        cluster.bandwidth_mbps, cluster.latency_ms, cluster.name,
    )  # fmt: skip
    try:
        fresh = make_plan("asteroid", Problem(w, survivors, cell.batch_size))
    except NoFeasiblePlan as exc:
        return Result(cell, f"survivors cannot hold the model: {exc}")
    result = Result(cell, "ok", fresh_predicted=score(fresh, w).throughput)
    result.survivors_shape = f"{len(fresh.stages)} stages, M={fresh.micro_batches}"

    # 1. ours: kill the devices mid-iteration, the coordinator recovers
    faults = Faults(fail=tuple(Fail(d, cell.fail_at, "forward") for d in cell.failed))
    try:
        run = train(plan, w, RunOptions(iterations=cell.iterations, emulate=True), faults=faults)
    except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the others go on
        return Result(cell, f"recovery failed: {str(exc).splitlines()[0]}")
    if not run.recoveries:
        return Result(cell, "no recovery happened")
    rec = run.recoveries[0]
    final = run.generations[-1]["generation"]
    interrupted = cell.fail_at - 1  # 0-based
    after = [it for it in run.iterations if it.get("generation") == final and it["iteration"] > interrupted]
    begun = [it for it in run.iterations if it["iteration"] == interrupted - 1]
    result.ours = Ours(
        real_s=rec["real_s"], detection_real_s=rec["detection_real_s"], planning_real_s=rec["planning_real_s"],
        setup_real_s=rec["setup_real_s"], device_s=rec["device_s"], restore_device_s=rec["restore_device_s"],
        replay_device_s=rec["replay_device_s"], iterations_lost=rec["iterations_lost"],
        throughput_before=rec["throughput_before"], throughput_after=_median_throughput(after, cell.batch_size),
        replicate_every=run.replicate_every, dilation=run.dilation,
        points=[(it["time"], it["throughput"], it.get("generation", 0)) for it in run.iterations],
        failure_time=begun[0]["time"] if begun else 0.0,
    )  # fmt: skip
    dilation = run.dilation

    # 2. the restart baseline, at the same replication period and dilation
    C = max(1, run.replicate_every)
    with tempfile.TemporaryDirectory(prefix="asteroid-restart-") as tmp:
        run_dir = Path(tmp)
        before = cell.fail_at - 1  # the iterations completed before the failure
        checkpoint = (before // C) * C if run.replicate_every else 0
        if checkpoint:
            train(plan, w, RunOptions(iterations=before, emulate=True, dilation=dilation), run_dir=run_dir,
                  replicate_every=C)  # fmt: skip
        ready: list[float] = []
        restores: list[float] = []

        def watch(ev: dict) -> None:
            if ev.get("type") == "device-start":
                ready.append(time.monotonic())
            elif ev.get("type") == "restore":
                restores.append(ev.get("device_s", 0.0))

        started = time.monotonic()
        resume = None
        if checkpoint:
            _, resume = load_resume(run_dir)
            checkpoint = resume["iteration"]
        restart_plan = make_plan("asteroid", Problem(w, survivors, cell.batch_size))
        try:
            again = train(
                restart_plan, w, RunOptions(iterations=cell.fail_at, emulate=True, dilation=dilation),
                on_event=watch, resume=resume, replicate_every=0,
            )  # fmt: skip
        except RunFailed as exc:
            result.status = f"restart failed: {str(exc).splitlines()[0]}"
            return result
        startup = (max(ready) if ready else started) - started
        retrained = [it for it in again.iterations if it["iteration"] >= checkpoint]
        result.restart = Restart(
            checkpoint_every=C, checkpoint_iteration=checkpoint, detection_real_s=rec["detection_real_s"],
            startup_real_s=startup, restore_device_s=max(restores, default=0.0),
            retrain_device_s=sum(it["iteration_s"] for it in retrained), retrained=len(retrained),
        )  # fmt: skip

    # 3. a short fresh run on the survivors, for the throughput a fresh plan really reaches
    if fresh_iterations:
        fresh_run = train(fresh, w, RunOptions(iterations=fresh_iterations + 1, emulate=True, dilation=dilation))
        result.fresh_measured = _median_throughput(fresh_run.iterations[1:], cell.batch_size)
    return result


def recovery(
    clusters: str = "C",
    models: tuple[str, ...] = QUICK_MODELS,
    bandwidths: tuple[float, ...] = (1000.0,),
    scenarios: tuple[str, ...] = ("one",),
    iterations: int = ITERATIONS,
    fail_at: int = FAIL_AT,
    fresh_iterations: int = 3,
) -> list[Result]:
    """Every cell that applies, one after the other; progress lines on stderr."""
    results = []
    for letter in clusters:
        for model in models:
            for mbps in bandwidths:
                for scenario in scenarios:
                    failed = victims(letter, scenario)
                    if failed is None:
                        continue
                    cell = Cell(letter, model, mbps, scenario, failed, fail_at, iterations)
                    print(f"recovery: {letter} {model} {mbps:g} Mbps, {', '.join(failed)} killed in iteration "
                          f"{fail_at}", file=sys.stderr, flush=True)  # fmt: skip
                    started = time.monotonic()
                    results.append(run_cell(cell, fresh_iterations))
                    print(f"  {results[-1].status} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return results


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def report(results: list[Result], command: str) -> str:
    """The markdown tables: ours split into its parts, the restart baseline, the ratios, throughput after."""
    lines = [
        f"Command: `{command}`. Real seconds (wall) and device seconds (emulated device time) are kept apart; "
        "each ratio is restart / ours on the same kind of seconds. The restart's detection is ours (same detector). "
        "Ours' wall is the whole recovery in real seconds, emulated device time (dilated) included; the real-second "
        "ratio compares the parts outside device time. 'at C/2' is derived, not measured: the restart's device "
        "seconds for a failure halfway through a checkpoint period at the measured iteration time.",
        "",
        "| cluster | model | Mbps | killed | ours real s (detect + plan + setup) | ours device s (restore + replay) "
        "| ours wall s | restart real s (detect + start-up) | restart device s (restore + re-train) | ratio real "
        "| ratio device | restart device s at C/2 (derived) | K = C | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.cell
        head = f"| {c.cluster} | {c.model} | {c.bandwidth_mbps:g} | {', '.join(c.failed)} @ {c.fail_at} |"
        if not r.ours:
            lines.append(f"{head} {r.status} | | | | | | | | | |")
            continue
        o, b = r.ours, r.restart
        ours_real = (
            f"{o.overhead_real_s:.3f} ({o.detection_real_s:.3f} + {o.planning_real_s:.3f} + {o.setup_real_s:.3f})"
        )
        ours_dev = f"{o.device_s:.2f} ({o.restore_device_s:.2f} + {o.replay_device_s:.2f})"
        if b:
            base_real = f"{b.real_s:.2f} ({b.detection_real_s:.3f} + {b.startup_real_s:.2f})"
            base_dev = (
                f"{b.device_s:.2f} ({b.restore_device_s:.2f} + {b.retrain_device_s:.2f}, "
                f"{b.retrained} it from {b.checkpoint_iteration})"
            )
        else:
            base_real, base_dev = r.status, "–"
        lines.append(
            f"{head} {ours_real} | {ours_dev} | {o.real_s:.1f} | {base_real} | {base_dev} | {_f(r.real_ratio, '.1f')}x "
            f"| {_f(r.device_ratio, '.1f')}x | {_f(b.mid_period_device_s if b else None)} | {o.replicate_every} "
            f"| {o.iterations_lost} |"
        )
    lines += [
        "",
        "| cluster | model | Mbps | killed | before (samples/s) | after | fresh plan, predicted | fresh plan, measured "
        "| after / fresh | survivors' plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ours:
            continue
        c, o = r.cell, r.ours
        lines.append(
            f"| {c.cluster} | {c.model} | {c.bandwidth_mbps:g} | {', '.join(c.failed)} | {o.throughput_before:.1f} "
            f"| {o.throughput_after:.1f} | {_f(r.fresh_predicted, '.1f')} | {_f(r.fresh_measured, '.1f')} "
            f"| {_f(r.of_fresh)} | {r.survivors_shape} |"
        )
    return "\n".join(lines)


def figure(results: list[Result], path: Path) -> list[Path]:
    """Throughput over device time through each failure, a dashed line where the killed iteration began."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in results:
        if not r.ours:
            continue
        c = r.cell
        name = f"{c.cluster} {c.model} {c.bandwidth_mbps:g} Mbps, {', '.join(c.failed)} killed"
        xs, ys, _ = zip(*r.ours.points, strict=True)
        trace = go.Scatter(x=xs, y=ys, mode="lines+markers", name=name)
        fig.add_trace(trace)
        fig.add_vline(x=r.ours.failure_time, line_dash="dash", annotation_text=f"failure ({c.model})")
    fig.update_layout(
        title="Throughput through a failure (Asteroid recovery)",
        xaxis_title="device time since start (s)",
        yaxis_title="throughput (samples/s)",
    )
    path = path.with_suffix(".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn")
    return [path]
