"""Why a plan leaves a device out: each unused device of its cluster tried in each stage beside that stage's
devices (the stage's micro-batch split again by the water fill, engine.allocation), and the best of those plans
set against the plan as it is. In words, for the plan page and the CLI."""

from __future__ import annotations

from dataclasses import replace

from engine import costmodel, schedule
from engine.allocation import allocate
from engine.costmodel import Workload
from engine.devices import GIB
from engine.plan import OFF, Plan, Prediction, Share


def left_out(plan: Plan, w: Workload) -> dict[str, str]:
    """{device: why the plan does better without it}, for every device of the plan's cluster no stage uses."""
    used = set(plan.device_names)
    spare = [d for d in plan.cluster.devices if d.name not in used]
    if not spare:
        return {}
    base = _expected(plan, w)
    out = {}
    for dev in spare:
        tries = [(p, t) for p in range(len(plan.stages)) if (t := with_device(plan, w, p, dev.name)) is not None]
        scored = [(p, _expected(t, w)) for p, t in tries]
        fitting = [(p, s) for p, s in scored if s.fits]
        if not fitting:
            out[dev.name] = (
                f"no stage of this plan fits in its {dev.memory_bytes / GIB:.1f} GiB beside the stage's devices"
                if not scored
                else "every stage it could join would run out of memory"
            )
            continue
        p, best = max(fitting, key=lambda ps: ps[1].expected_throughput)
        peers = ", ".join(s.name for s in plan.stages[p].devices)
        with_it, without = best.expected_throughput, base.expected_throughput
        if with_it >= without * (1 - 1e-9):
            out[dev.name] = (f"adding it to stage {p} (beside {peers}) gains nothing: {with_it:.1f} samples/s "
                             "predicted either way")  # fmt: skip
        else:
            out[dev.name] = (f"with it in stage {p} (beside {peers}), its best place, the plan would predict "
                             f"{with_it:.1f} samples/s against {without:.1f} without it: "
                             f"{_why(plan, w, p, dev.name)}")  # fmt: skip
    return out


def _expected(plan: Plan, w: Workload) -> Prediction:
    """The plan's prediction with its simulated iteration (the figure the plan is shown with)."""
    from engine.planners.common import simulated

    if plan.predicted is None or plan.predicted.simulated_s is None:
        plan = simulated(plan.with_prediction(costmodel.score(plan, w)), w)
    return plan.predicted


def with_device(plan: Plan, w: Workload, p: int, name: str) -> Plan | None:
    """The plan with device `name` added to stage `p`, the stage's micro-batch split again; None if it cannot."""
    st = plan.stages[p]
    names = [s.name for s in st.devices] + [name]
    held = schedule.in_flight(len(plan.stages), plan.micro_batches, p, plan.schedule)
    levels = (plan.level(p - 1) if p else OFF, plan.level(p))
    terms = [costmodel.stage_terms(w, plan.cluster, plan.cluster.device(n), st.start, st.end, held, levels)
             for n in names]  # fmt: skip
    found = allocate(terms, [1] * len(names), st.samples)
    if found is None:
        return None
    shares = tuple(Share(n, k[0]) for n, k in zip(names, found[1], strict=True))
    stages = list(plan.stages)
    stages[p] = replace(st, devices=shares)
    return replace(plan, stages=tuple(stages), predicted=None)


def _why(plan: Plan, w: Workload, p: int, name: str) -> str:
    """What it costs in stage `p`: its speed against the stage's devices' on the stage's layers, and the stage's
    all-reduce with one more device."""
    st, cluster = plan.stages[p], plan.cluster
    own = w.compute_s(cluster.device(name), st.start, st.end)
    fastest = min(w.compute_s(cluster.device(s.name), st.start, st.end) for s in st.devices)
    names = tuple(s.name for s in st.devices)
    before = costmodel.allreduce_s(w, cluster, st.start, st.end, len(names), plan.allreduce, names)
    after = costmodel.allreduce_s(w, cluster, st.start, st.end, len(names) + 1, plan.allreduce, (*names, name))
    parts = []
    if own > fastest * 1.05:
        parts.append(f"it computes these layers {own / fastest:.1f}x slower than the stage's fastest device")
    if after > before * 1.05:
        parts.append(f"the stage's all-reduce would take {after * 1e3:.0f} ms instead of {before * 1e3:.0f} ms")
    return "; ".join(parts) or "the time it adds outweighs the samples it takes"
