"""`python -m engine bench recovery`: Asteroid's recovery from lost devices against a checkpoint restart."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BATCH = 32
ITERATIONS = 10
FAIL_AT = 6  # 1-based: the iteration during which the devices die
REPLICATE_EVERY = 2  # the bench's K (and the restart's C): the failure comes after a replication point
QUICK_MODELS = ("mobilenetv2", "gpt-small")
MODELS = ("mobilenetv2", "gpt-small", "resnet50")
# one device (tx2-1); the NX of C (the only one of its kind); the device of a single-device stage; two at once
SCENARIOS = ("one", "nx", "stage", "two")


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
    replicate_every: int = REPLICATE_EVERY


@dataclass
class Ours:
    wall_s: float  # failure to the first new iteration, real seconds, emulated (dilated) device time included
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
    summary: str = ""  # the coordinator's one-line account of the recovery
    late: str = ""  # late steps of all steps ("3/820"): many late ones make the emulation dishonest

    @property
    def overhead_real_s(self) -> float:
        """Detection + planning + set-up: the real seconds of the recovery outside emulated device time."""
        return self.detection_real_s + self.planning_real_s + self.setup_real_s


@dataclass
class Overhead:
    """What replication costs, measured in the fault-free iterations of ours before the failure: iterations
    that end a replication period carry its copies; the others are the plain iteration."""

    measured_s: float  # device seconds a replication point added (mean over those iterations less the plain)
    predicted_s: float  # the cost model's (costmodel.replication_s)
    plain_iteration_s: float
    default_every: int  # the period train picks by default (at most 4 % predicted)

    @property
    def at_default(self) -> float:
        """The measured copy cost as a fraction of throughput at the default period."""
        return self.measured_s / (self.measured_s + self.default_every * self.plain_iteration_s)


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
    overhead: Overhead | None = None

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


def victims(plan, scenario: str) -> tuple[str, ...] | None:
    """The devices a scenario kills in a plan (None: the scenario does not apply to it)."""
    names = plan.device_names
    if scenario == "one":
        return ("tx2-1",) if "tx2-1" in names else (names[1],) if len(names) > 1 else None
    if scenario == "nx":
        nx = [d.name for d in plan.cluster.devices if d.name.startswith("nx-")]
        return (nx[0],) if len(nx) == 1 and nx[0] in names else None
    if scenario == "stage":
        alone = [st.devices[0].name for st in plan.stages if len(st.devices) == 1]
        return (alone[-1],) if alone and len(plan.stages) > 1 else None
    if scenario == "two":
        return tuple(names[1:3]) if len(names) > 2 else None
    raise ValueError(scenario)


def _median_throughput(iterations: list[dict], batch: int) -> float:
    return batch / statistics.median(it["iteration_s"] for it in iterations) if iterations else 0.0


def run_cell(cell: Cell, plan, fresh_iterations: int = 2) -> Result:
    """One cell, measured for real.

    Every cell trains one model on one emulated cluster, replicating every `cell.replicate_every` iterations,
    kills devices mid-iteration (a real SIGKILL) and measures:

    - ours: the coordinator's own `recovered` report (detection, planning and set-up in real seconds; restore and
      replayed iterations in device seconds), the throughput after the recovery against a fresh plan on the same
      survivors (the cost model's prediction, and a short fresh run on them when `fresh_iterations` > 0), and what
      a replication point cost in the iterations before the failure;
    - the restart baseline (what torchelastic does): a fault-free run writes a checkpoint every C iterations
      (C = K, so both pay for the same copies) up to the last checkpoint before the failure; then everything
      restarts on the survivors with a fresh plan, loads that checkpoint and re-trains up to and including the
      interrupted iteration. Its detection is taken to be ours (the same heartbeat detector); its start-up is
      measured (the checkpoint load, planning, and process start until every device reported ready), its device
      seconds are the restore from the checkpoint and the re-trained iterations, all measured.

    Real and device seconds are never added together: the ratio baseline / ours is given for each separately.
    """
    from engine.costmodel import replication_s, score
    from engine.planners import NoFeasiblePlan, Problem, make_plan
    from engine.runtime.central import load_resume
    from engine.runtime.coordinator import RunFailed, replicate_every_default
    from engine.runtime.faults import Fail, Faults
    from engine.runtime.launcher import RunOptions, train
    from engine.workloads import workload

    w = workload(cell.model)
    cluster = plan.cluster
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
    K = cell.replicate_every

    # 1. ours: kill the devices mid-iteration, the coordinator recovers
    faults = Faults(fail=tuple(Fail(d, cell.fail_at, "forward") for d in cell.failed))
    try:
        run = train(plan, w, RunOptions(iterations=cell.iterations, emulate=True), faults=faults, replicate_every=K)
    except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the others go on
        return Result(cell, f"recovery failed: {str(exc).splitlines()[0]}")
    if not run.recoveries:
        return Result(cell, "no recovery happened")
    rec = run.recoveries[0]
    final = run.generations[-1]["generation"]
    interrupted = cell.fail_at - 1  # 0-based
    after = [  # the final generation's iterations after the interrupted one, less those carrying copies
        it
        for it in run.iterations
        if it.get("generation") == final and it["iteration"] > interrupted and it["iteration"] % K
    ]
    begun = [it for it in run.iterations if it["iteration"] == interrupted - 1]
    result.ours = Ours(
        wall_s=rec["wall_s"], detection_real_s=rec["detection_real_s"], planning_real_s=rec["planning_real_s"],
        setup_real_s=rec["setup_real_s"], device_s=rec["device_s"], restore_device_s=rec["restore_device_s"],
        replay_device_s=rec["replay_device_s"], iterations_lost=rec["iterations_lost"],
        throughput_before=rec["throughput_before"], throughput_after=_median_throughput(after, cell.batch_size),
        replicate_every=run.replicate_every, dilation=run.dilation,
        points=[(it["time"], it["throughput"], it.get("generation", 0)) for it in run.iterations],
        failure_time=begun[0]["time"] if begun else 0.0, summary=rec["summary"], late=f"{run.late_steps}/{run.steps}",
    )  # fmt: skip
    fault_free = run.iterations[1:interrupted]  # the first iteration (warm-up) left out
    result.overhead = _overhead(fault_free, K, replication_s(plan, w), replicate_every_default(plan, w))
    dilation = run.dilation

    # 2. the restart baseline, at the same period and dilation
    with tempfile.TemporaryDirectory(prefix="asteroid-restart-") as tmp:
        run_dir = Path(tmp)
        checkpoint = (interrupted // K) * K  # iterations done at the last checkpoint before the failure
        if checkpoint:
            train(plan, w, RunOptions(iterations=checkpoint + 1, emulate=True, dilation=dilation), run_dir=run_dir,
                  replicate_every=K)  # fmt: skip
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
            checkpoint_every=K, checkpoint_iteration=checkpoint, detection_real_s=rec["detection_real_s"],
            startup_real_s=startup, restore_device_s=max(restores, default=0.0),
            retrain_device_s=sum(it["iteration_s"] for it in retrained), retrained=len(retrained),
        )  # fmt: skip

    # 3. a short fresh run on the survivors, for the throughput a fresh plan really reaches
    if fresh_iterations:
        fresh_run = train(fresh, w, RunOptions(iterations=fresh_iterations + 1, emulate=True, dilation=dilation))
        result.fresh_measured = _median_throughput(fresh_run.iterations[1:], cell.batch_size)
    return result


def _overhead(iterations: list[dict], K: int, predicted_s: float, default_every: int) -> Overhead | None:
    """The replication points' extra device seconds among fault-free iterations: an iteration numbered k
    (0-based) carries the copies made after iteration k - 1 when k % K == 0."""
    copying = [it["iteration_s"] for it in iterations if it["iteration"] % K == 0]
    plain = [it["iteration_s"] for it in iterations if it["iteration"] % K]
    if not copying or not plain:
        return None
    base = statistics.median(plain)
    return Overhead(statistics.mean(copying) - base, predicted_s, base, default_every)


def recovery(
    clusters: str = "C",
    models: tuple[str, ...] = QUICK_MODELS,
    bandwidths: tuple[float, ...] = (1000.0,),
    scenarios: tuple[str, ...] = ("one",),
    iterations: int = ITERATIONS,
    fail_at: int = FAIL_AT,
    fresh_iterations: int = 2,
    batch_size: int = BATCH,
    replicate_every: int = REPLICATE_EVERY,
) -> list[Result]:
    """Every cell that applies, one after the other; progress lines on stderr."""
    from engine.devices import load_cluster
    from engine.planners import NoFeasiblePlan, Problem, make_plan
    from engine.workloads import workload

    results = []
    for letter in clusters:
        for model in models:
            for mbps in bandwidths:
                try:
                    plan = make_plan("asteroid", Problem(workload(model), load_cluster(letter, mbps), batch_size))
                except NoFeasiblePlan as exc:
                    cell = Cell(letter, model, mbps, "-", (), fail_at, iterations, batch_size, replicate_every)
                    results.append(Result(cell, f"no plan: {exc}"))
                    continue
                for scenario in scenarios:
                    failed = victims(plan, scenario)
                    if failed is None:
                        continue
                    cell = Cell(letter, model, mbps, scenario, failed, fail_at, iterations, batch_size, replicate_every)
                    print(f"recovery: {letter} {model} {mbps:g} Mbps, {', '.join(failed)} killed in iteration "
                          f"{fail_at}", file=sys.stderr, flush=True)  # fmt: skip
                    started = time.monotonic()
                    results.append(run_cell(cell, plan, fresh_iterations))
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
            f"{head} {ours_real} | {ours_dev} | {o.wall_s:.1f} | {base_real} | {base_dev} | {_f(r.real_ratio, '.1f')}x "
            f"| {_f(r.device_ratio, '.1f')}x | {_f(b.mid_period_device_s if b else None)} | {o.replicate_every} "
            f"| {o.iterations_lost} |"
        )
    lines += [
        "",
        "| cluster | model | Mbps | killed | before (samples/s) | after | fresh plan, predicted | fresh plan, measured "
        "| after / fresh | survivors' plan | late steps (ours) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ours:
            continue
        c, o = r.cell, r.ours
        lines.append(
            f"| {c.cluster} | {c.model} | {c.bandwidth_mbps:g} | {', '.join(c.failed)} | {o.throughput_before:.1f} "
            f"| {o.throughput_after:.1f} | {_f(r.fresh_predicted, '.1f')} | {_f(r.fresh_measured, '.1f')} "
            f"| {_f(r.of_fresh)} | {r.survivors_shape} | {o.late} |"
        )
    lines += [
        "",
        "Replication overhead: the device seconds a replication point added in the fault-free iterations of ours "
        "(measured: the mean of the iterations that carried copies less the median of the others) against the "
        "cost model's, and what that measured cost is at the default period train picks (at most 4 % predicted).",
        "",
        "| cluster | model | Mbps | per replication point, measured s | predicted s | plain iteration s "
        "| default K | overhead at default K (from measured) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in results:
        c, o = r.cell, r.overhead
        if not o or (c.cluster, c.model, c.bandwidth_mbps) in seen:
            continue
        seen.add((c.cluster, c.model, c.bandwidth_mbps))
        lines.append(
            f"| {c.cluster} | {c.model} | {c.bandwidth_mbps:g} | {o.measured_s:.3f} | {o.predicted_s:.3f} "
            f"| {o.plain_iteration_s:.3f} | {o.default_every} | {o.at_default:.1%} |"
        )
    lines += ["", "What the coordinator printed for each recovery:", ""]
    lines += [
        f"- {r.cell.cluster} {r.cell.model} {r.cell.bandwidth_mbps:g} Mbps: `{r.ours.summary}`"
        for r in results
        if r.ours
    ]
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
    from engine.bench.render import write_figure

    return write_figure(fig, path, png=False)
