"""Planning a job: the cluster of its devices, every method's plan, and the simulated iteration of Asteroid's."""

from __future__ import annotations

from collections.abc import Callable

from engine.compression import parse_compression
from engine.data import train_size
from engine.devices import Cluster
from engine.errors import UserError
from engine.models import get_model
from engine.plan import Plan
from engine.planners import COMPARED, NoFeasiblePlan, Problem
from engine.planners.explain import left_out
from engine.planners.feasibility import Infeasible, diagnose
from engine.planners.levels import plan_compressed
from engine.recipe import planned
from engine.runtime.options import RunOptions
from webapp.devices.models import Device

Progress = Callable[[float, str], None]


def pick_devices(
    requested: list[str], dataset: str = "synthetic", group: str = "", count: int | None = None, compute: str = "auto"
) -> list[list[Device]]:
    """The sets of devices a job may be planned on, in order of preference; a UserError says what is wrong.
    Emulated and real boards cannot share a run: a job that names devices names one kind; one that names none
    is planned on the real boards that are online and idle, else (none, or they cannot hold the model) on the
    emulated ones; when every one is busy, on the busy ones (launched, the job waits in line for them). Named
    devices may be busy. Instead of names, a job may ask for a `group`'s devices, and for any `count` of them:
    the idle ones first, the fastest first, then busy ones. Only devices that have the `dataset`'s data (their
    agents say which) train on it, and only those with a GPU when the job's `compute` device is cuda."""
    if not requested:
        where = f" in group {group}" if group else ""
        pool = [d for d in Device.objects.all() if d.in_service and (not group or d.group == group)]
        if not pool:
            if group and not Device.objects.filter(group=group).exists():
                raise UserError(f"no device is in group {group!r}")
            raise UserError(f"no device{where} is online: start the device agents (make run starts emulated ones)")
        pool = [d for d in pool if d.serves(dataset)] or no_data(pool, dataset)
        pool = [d for d in pool if d.computes(compute)] or no_gpu(pool)
        kinds = [k for k in ([d for d in pool if not d.emulated], [d for d in pool if d.emulated]) if k]
        if count:
            enough = [
                sorted(k, key=lambda d: (not d.available, -d.gflops, d.name))[:count] for k in kinds if len(k) >= count
            ]
            if not enough:
                most = max(len(k) for k in kinds)
                raise UserError(f"{count} devices asked for, but only {most} of one kind{where} are online with "
                                f"{dataset} data: ask for at most {most}")  # fmt: skip
            return enough
        idle = [[d for d in k if d.available] for k in kinds]
        return [k for k in idle if k] or kinds
    found = {d.name: d for d in Device.objects.filter(name__in=requested)}
    unknown = [n for n in requested if n not in found]
    if unknown:
        raise UserError(f"unknown device(s): {', '.join(unknown)}")
    out = [f"{d.name} ({d.status})" for d in found.values() if not d.in_service]
    if out:
        raise UserError(
            f"not online: {', '.join(out)}; pick other devices, or start their agents (staff enable a "
            "disabled or failed one on the devices page)"
        )
    devices = [found[n] for n in requested]
    unmixed(devices)
    lacking = [d for d in devices if not d.serves(dataset)]
    if lacking:
        no_data(lacking, dataset)
    cpu_only = [d for d in devices if not d.computes(compute)]
    if cpu_only:
        no_gpu(cpu_only)
    return [devices]


def passed_over(
    planned: list[Device],
    requested: list[str],
    dataset: str,
    group: str = "",
    count: int | None = None,
    compute: str = "auto",
) -> dict[str, str]:
    """Why each registered device outside `planned` (the devices the job was planned on) was not given to the
    planner; devices a job that names its own (or a group) did not name are not listed."""
    names = {d.name for d in planned}
    emulated = bool(planned) and planned[0].emulated
    out = {}
    for d in Device.objects.all():
        if d.name in names or (requested and d.name not in requested) or (group and d.group != group):
            continue
        if not d.in_service:
            out[d.name] = f"{d.status}: its agent is not connected" if d.status == "offline" else f"{d.status}"
        elif not d.serves(dataset):
            out[d.name] = f"its agent has no {dataset} data"
        elif not d.computes(compute):
            out[d.name] = "no CUDA GPU: the job's Compute device is cuda"
        elif d.emulated != emulated:
            kind = "emulated" if d.emulated else "a real board"
            out[d.name] = f"{kind}: emulated and real boards cannot share a run"
        elif count:
            out[d.name] = f"not among the {count} devices asked for (the idle ones first, the fastest first)"
        elif not d.available:
            out[d.name] = f"busy with job {d.job_id}: the job was planned on the idle devices"
    return out


def no_data(devices: list[Device], dataset: str):
    """Refuse `devices`, which lack the `dataset`'s data, saying how to give it to them."""
    names = ", ".join(d.name for d in devices)
    agent = "their agents'" if len(devices) > 1 else "its agent's"
    where = f"{agent} ASTEROID_DATA_DIR (~/.cache/asteroid/data) and restart {'them' if len(devices) > 1 else 'it'}"
    how = f"put CIFAR-10's python batch files in {where}" if dataset == "cifar10" else f"give them its data in {where}"
    raise UserError(
        f"{names} {'have' if len(devices) > 1 else 'has'} no {dataset} data: {how}, or pick another dataset"
    )


def no_gpu(devices: list[Device]):
    """Refuse `devices`, whose agents compute on their CPU, for a job that asks for CUDA."""
    names = ", ".join(d.name for d in devices)
    raise UserError(
        f"{names} {'compute' if len(devices) > 1 else 'computes'} on the CPU (torch sees no CUDA GPU there) but the "
        "job's Compute device is cuda: choose auto (each board's GPU when it has one) or cpu, or other devices"
    )


def unmixed(devices: list[Device]) -> None:
    """Refuse a set of devices that mixes emulated and real boards, naming which are which."""
    emulated = [d.name for d in devices if d.emulated]
    real = [d.name for d in devices if not d.emulated]
    if emulated and real:
        raise UserError(
            f"{', '.join(emulated)} {'are' if len(emulated) > 1 else 'is'} emulated and {', '.join(real)} "
            f"{'are' if len(real) > 1 else 'is'} real: they cannot share a run; pick devices of one kind"
        )


def plan_all(
    model: str,
    batch_size: int,
    devices: list[Device],
    bandwidth_mbps: float,
    progress: Progress,
    compression: str = "off",
    schedule: str = "auto",
    dataset: str = "synthetic",
    recipe: RunOptions | None = None,
) -> dict:
    """Every compared method's plan (or why it has none) for the devices at the `compression` levels and under
    the `schedule` (the CLI's `--compression` and `--schedule`); Asteroid's must exist and fit. Changes of
    activations (`delta:…`) keep at most the `dataset`'s training samples per pair.
    Returns {"plan": ..., "comparison": {method: plan or {"error"}}, "simulation": [step, ...]}."""
    from engine.simulator import simulate
    from engine.workloads import workload

    devices = tuple(d.to_engine(bandwidth_mbps) for d in devices)  # a board measured on a slow link has its own
    cluster = Cluster(devices, bandwidth_mbps=bandwidth_mbps, name="")  # messages say "the N devices given"
    progress(0.0, f"profiling {model} (cached after the first job)")
    w = workload(model, cluster=cluster)
    if recipe is not None:  # as the job trains it: its optimizer's state, its frozen weights (engine.recipe)
        w = planned(w, recipe)
    problem = Problem(w, cluster, batch_size, schedule=schedule)
    asked = parse_compression(compression)
    samples = train_size(dataset, get_model(model)) if asked.delta else None
    comparison: dict[str, Plan | str] = {}  # each method's plan, or why it has none
    for k, method in enumerate(COMPARED):
        progress(k / len(COMPARED), f"planning with {method}")
        try:
            plan = plan_compressed(method, problem, *asked, samples=samples)
            comparison[method] = plan if plan.predicted.fits else "does not fit in memory"
        except NoFeasiblePlan as exc:
            comparison[method] = str(exc).splitlines()[0]
    best = comparison["asteroid"]
    if not isinstance(best, Plan):
        raise UserError(infeasible_message(diagnose(problem, "asteroid")))
    progress(0.95, "simulating an iteration of the plan")
    steps = [e.to_dict() for e in simulate(best, w).events]
    return {
        "plan": best.to_dict(),
        "left_out": left_out(best, w),  # why the planner did better without a device it was given
        "comparison": {m: p.to_dict() if isinstance(p, Plan) else {"error": p} for m, p in comparison.items()},
        "simulation": steps,
    }


def infeasible_message(why: Infeasible) -> str:
    """What does not fit, and the batch size to ask for instead (the CLI's advice, in the form's words)."""
    if why.fitting_batch_size is None:
        return f"{why.summary}; it does not fit even at batch size 1"
    n = why.fitting_batch_size
    return f"{why.summary}; the largest batch size that fits is about {n}: try batch size {n}"


def planned_compute(plan: Plan, recipe: RunOptions) -> dict[str, float]:
    """Each device's planned compute (forward and backward) in one iteration of `plan` trained by `recipe`, in
    seconds: what the live page measures its steps against (the coordinator's drift check does the same)."""
    from engine.steps import device_steps
    from engine.workloads import workload

    w = planned(workload(plan.model, cluster=plan.cluster), recipe)  # the profile its planning cached
    return {name: plan.micro_batches * (s.forward_s + s.backward_s) for name, s in device_steps(plan, w).items()}
