"""The GPU check (`make gpu-check`, `python -m engine bench gpu`): one line per result, on one machine's CUDA GPU.

Every device process of a run computes on the one GPU (several processes share it), real compute, no emulation:
  - a pipeline equals one process: fp32 (and each 16-bit format the GPU computes) against one process on that GPU;
  - a device killed mid-iteration, the run recovered (replayed) on the GPU, equal to the run without the kill;
  - measured against predicted: a plan made from per-layer profiles measured on this GPU, trained on it;
  - measured against planned memory: each device's peak from torch's allocator against the plan's budget;
  - GPU against CPU throughput of the same plan.
`--device cpu` runs the same check on the CPU (what CI's machines can run: the check's own code, not the GPU's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.costmodel import Workload
from engine.devices import GIB, Cluster, Device
from engine.plan import Plan, Share, Stage

MODEL = "gpt-small"  # no BatchNorm, no dropout: a pipeline's result is one process's, to rounding
BATCH, MICRO, ITERATIONS = 16, 4, 4
# one device, two devices sharing 3:1, two sharing 1:3 (slices cross between the groups)
STAGES = [(0, 5, [("d0", 4)]), (5, 11, [("d1", 3), ("d2", 1)]), (11, 15, [("d3", 1), ("d4", 3)])]


def gpu_check(device: str = "cuda", say: Callable[[str], None] = print) -> bool:
    """Run every check on `device`, saying one line per result; True when all passed."""
    from engine.runtime.placement import resolve

    where = resolve(device)  # UserError when no GPU is there
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "the CPU"
    say(f"gpu-check on {name} (torch {torch.__version__}, {MODEL}, batch {BATCH}, {ITERATIONS} iterations)")
    results = []
    for check in (_equivalence, _recovery, _predicted, _throughput):
        started = time.monotonic()
        try:
            lines = check(where.type)
        except Exception as exc:  # one check's failure is its line; the others still run
            lines = [(False, f"{check.__name__.strip('_')}: {type(exc).__name__}: {exc}")]
        for ok, text in lines:
            results.append(ok)
            say(f"{'PASS' if ok else 'FAIL'} {text} [{time.monotonic() - started:.0f} s]")
    say(f"gpu-check: {sum(results)} of {len(results)} passed")
    return all(results)


def _plan(kind: str = "jetson-xavier-nx") -> Plan:
    names = [n for _, _, devs in STAGES for n, _ in devs]
    cluster = Cluster(tuple(Device.of_kind(n, kind) for n in names), 1000.0, name="gpu-check")
    stages = tuple(Stage(a, b, tuple(Share(n, s) for n, s in devs)) for a, b, devs in STAGES)
    return Plan("hand", MODEL, BATCH, MICRO, stages, cluster)


def _options(device: str, **kw):
    from engine.runtime.options import RunOptions

    return RunOptions(
        iterations=ITERATIONS, lr=0.05, emulate=False, save_model=True, timeout_s=120, device=device, **kw
    )


def _workload() -> Workload:
    from engine.workloads import workload

    return workload(MODEL)


def _worst(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _equivalence(device: str) -> list[tuple[bool, str]]:
    from engine.runtime.launcher import train
    from engine.runtime.placement import Placement
    from engine.runtime.reference import one_process

    out = []
    runs = [("fp32", "1f1b"), ("fp32", "zb-h1"), ("fp16", "1f1b")]  # zb-h1: the backward split in two (B, W)
    runs += [("bf16", "1f1b")] if device == "cpu" or torch.cuda.is_bf16_supported(False) else []
    for precision, schedule in runs:
        opts = _options(device, precision=precision, schedule=schedule)
        Placement.resolve(device).check_precision(precision)
        result = train(_plan().with_schedule(schedule), _workload(), opts)
        ref_losses, ref_state = one_process(MODEL, BATCH, opts, device)
        close = 1e-4 if precision == "fp32" else 2e-2  # 16-bit: the same rounding, summed in another order
        gap = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(result.loss, ref_losses))
        worst = _worst(result.state_dict, ref_state)
        ok = gap <= close and (precision != "fp32" or worst < 1e-4)
        within = f"losses within {gap:.1e} (allowed {close:.0e}), weights within {worst:.1e}"
        out.append((ok, f"pipeline = one process, {precision} {schedule} on {device}: {within}; 5 processes, 3 stages"))
    return out


def _recovery(device: str) -> list[tuple[bool, str]]:
    from engine.runtime.faults import Faults, parse_fail
    from engine.runtime.launcher import train

    opts = replace(_options(device), iterations=5)
    whole = train(_plan(), _workload(), opts, replicate_every=2)
    killed = train(_plan(), _workload(), opts, faults=Faults(fail=(parse_fail("d1@4:backward"),)), replicate_every=2)
    worst = _worst(killed.state_dict, whole.state_dict)
    same = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(killed.loss, whole.loss))
    ok = same and worst < 1e-4 and len(killed.recoveries) == 1 and len(killed.iterations) == 5
    after = f"recovered on {len(killed.devices)} devices, {len(killed.iterations)} iterations"
    result = f"losses {'equal' if same else 'DIFFER'}, weights within {worst:.1e} of the run without the kill"
    return [(ok, f"d1 killed in iteration 4's backward on {device}: {after}, {result}")]


def _predicted(device: str) -> list[tuple[bool, str]]:
    """One device on this GPU (or CPU), planned from profiles measured on it, so nothing shares what it measures;
    then the 5-device plan's memory."""
    from engine.cli.plan import fitting_plan
    from engine.planners import Problem
    from engine.profiler import cached_profile
    from engine.runtime.launcher import train
    from engine.simulator import simulate

    # profiled at the whole batch: one device runs it as one micro-batch, and a GPU's time per sample is far from
    # constant over batch sizes (the cost model scales it linearly)
    profile = cached_profile(MODEL, micro_batch=BATCH, device=device, progress=False)
    times = ([lp.forward_s for lp in profile.layers], [lp.backward_s for lp in profile.layers])
    here = torch.cuda.current_device() if device == "cuda" else None
    memory = torch.cuda.get_device_properties(here).total_memory if device == "cuda" else 16 * GIB
    solo = Cluster((Device("gpu-0", "custom", memory / GIB, 1000.0, 0.0),), 1000.0, name="one")
    w = replace(Workload.from_profile(profile), device_times={"gpu-0": times})
    plan = fitting_plan("asteroid", Problem(w, solo, BATCH))
    result = train(plan, w, replace(_options(device), iterations=6, save_model=False))
    measured, predicted = result.measured_iteration_s, result.predicted_iteration_s
    ratio = measured / predicted
    run = f"profiled there, one device, {plan.micro_batches} micro-batch(es)"
    took = f"{measured * 1e3:.1f} ms per iteration against {predicted * 1e3:.1f} ms, ratio {ratio:.2f}"
    out = [(0.5 <= ratio <= 2.0, f"measured against predicted on {device} ({run}): {took}")]
    five = train(_plan(), _workload(), replace(_options(device), save_model=False))
    meter = "torch.cuda.max_memory_allocated" if device == "cuda" else "counted"
    for name, planned in sorted(simulate(_plan(), _workload()).memory_bytes.items()):
        peak = five.devices[name]["peak_memory_bytes"]
        text = f"peak {peak / 2**20:.1f} MiB measured ({meter}) against {planned / 2**20:.1f} MiB planned"
        out.append((0.25 <= peak / planned <= 2.0, f"memory of {name} on {device}: {text}"))
    return out


def _throughput(device: str) -> list[tuple[bool, str]]:
    from engine.runtime.launcher import train

    opts = replace(_options(device), iterations=6, save_model=False)
    runs = {d: train(_plan(), _workload(), replace(opts, device=d)) for d in dict.fromkeys([device, "cpu"])}
    text = ", ".join(f"{d} {r.throughput:.1f} samples/s" for d, r in runs.items())
    ratio = runs[device].throughput / runs["cpu"].throughput
    if device == "cpu":
        return [
            (True, f"the same plan (5 processes, 3 stages) on the CPU: {text} (the GPU's figure is the check's point)")
        ]
    return [(True, f"the same plan (5 processes, 3 stages) on {device} against the CPU: {text}, ratio {ratio:.2f}")]
