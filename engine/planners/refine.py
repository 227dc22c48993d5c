"""Local refinement under the simulator: from a plan, take the best single move until none simulates faster.

The planner searches on the cost model's closed form and ranks a few near-optima by the event-driven simulator
(engine.planners.asteroid). The simulator sees what the closed form does not (sends overlapping compute, the
schedule's own fill and drain), so a plan one move away can run faster. The moves: a cut between two stages
one layer earlier or later; one sample from a device to another of its stage; a device to a neighbouring
stage, with one sample taken from that stage's largest share (its own samples go to its old stage's largest
share). Each round simulates every move that fits in memory and that its busiest device's compute does not
already rule out (`common.busy_bound`), and keeps the fastest if it beats the plan; it stops when none does, or
after MAX_SIMULATIONS simulations (a deterministic bound, so a plan is repeatable).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from engine.costmodel import Workload, score
from engine.plan import Plan, Prediction, Share, Stage
from engine.planners.common import busy_bound
from engine.simulator import simulate
from engine.steps import device_steps

MAX_SIMULATIONS = 300
GAIN = 1e-6  # a move must simulate at least this share faster: ties and float noise do not move the plan


@dataclass
class _Known:
    """What a refinement worked out about one candidate plan, each part when it first needed it."""

    prediction: Prediction
    steps: dict | None = None
    bound: float | None = None  # its busiest device's compute alone (`common.busy_bound`)
    simulated_s: float | None = None


def refine(
    plan: Plan,
    w: Workload,
    budget: int = MAX_SIMULATIONS,
    cuts_only: bool = False,
    seen: dict | None = None,
    memo: dict | None = None,
) -> Plan:
    """`plan` improved by single moves while one simulates faster (same schedule, same micro-batches); `cuts_only`:
    by moving its cuts alone (2 (S - 1) moves a round instead of dozens). `seen`: what earlier refinements of the
    same problem worked out per plan, to reuse (a round meets the move that undoes the last one, and a refinement
    after a cut-only one meets its last round's moves again); a plan met again counts against the budget as if
    simulated again, so the result is the same with or without it. `memo`: the stages worked out before
    (`costmodel.score`; a move changes one or two stages and their neighbours' sends)."""
    seen = {} if seen is None else seen
    memo = {} if memo is None else memo
    best = _simulated(plan, w, memo)
    spent = 0
    while spent < budget:
        found = None
        for stages in moves(best.stages, cuts_only):
            if spent >= budget:
                break
            candidate = replace(best, stages=stages, predicted=None)
            if candidate not in seen:
                seen[candidate] = _Known(score(candidate, w, memo=memo))
            known = seen[candidate]
            if not known.prediction.fits:
                continue
            beat = best.predicted.simulated_s * (1 - GAIN) if found is None else found[0]
            if known.bound is None:
                known.steps = device_steps(candidate, w, memo)
                known.bound = busy_bound(candidate, w, known.steps)
            if known.bound >= beat:  # its busiest device alone takes longer: it cannot win
                continue
            spent += 1
            if known.simulated_s is None:
                known.simulated_s = simulate(
                    candidate, w, timeline=False, known=(known.prediction, known.steps)
                ).iteration_s
            if known.simulated_s < beat:
                t = known.simulated_s
                found = (t, candidate.with_prediction(replace(known.prediction, simulated_s=t)))
        if found is None:
            break
        best = found[1]
    return best


def _simulated(plan: Plan, w: Workload, memo: dict) -> Plan:
    if plan.predicted is not None and plan.predicted.simulated_s is not None:
        return plan
    prediction = plan.predicted or score(plan, w, memo=memo)
    iteration_s = simulate(plan, w, timeline=False, memo=memo).iteration_s
    return plan.with_prediction(replace(prediction, simulated_s=iteration_s))


def moves(stages: tuple[Stage, ...], cuts_only: bool = False) -> Iterator[tuple[Stage, ...]]:
    """Every plan one move from `stages`, in a fixed order: cuts, then (unless `cuts_only`) samples, then devices."""
    S = len(stages)
    for k in range(S - 1):  # the cut after stage k, one layer either way
        a, b = stages[k], stages[k + 1]
        for shift in (-1, 1):
            cut = a.end + shift
            if a.start < cut < b.end:
                yield _with(stages, {k: replace(a, end=cut), k + 1: replace(b, start=cut)})
    if cuts_only:
        return
    for k, st in enumerate(stages):  # one sample between two devices of a stage
        for i, giver in enumerate(st.devices):
            if giver.samples < 2:
                continue
            for j in range(len(st.devices)):
                if j != i:
                    shares = list(st.devices)
                    shares[i] = Share(giver.name, giver.samples - 1)
                    shares[j] = Share(shares[j].name, shares[j].samples + 1)
                    yield _with(stages, {k: replace(st, devices=tuple(shares))})
    for k, st in enumerate(stages):  # a device of a stage of several to a neighbouring stage
        if len(st.devices) < 2:
            continue
        for i, dev in enumerate(st.devices):
            for to in (k - 1, k + 1):
                if not 0 <= to < S:
                    continue
                target = stages[to]
                big = max(range(len(target.devices)), key=lambda n: target.devices[n].samples)
                if target.devices[big].samples < 2:
                    continue
                left = [s for n, s in enumerate(st.devices) if n != i]
                keep = max(range(len(left)), key=lambda n: left[n].samples)
                left[keep] = Share(left[keep].name, left[keep].samples + dev.samples)
                joined = list(target.devices)
                joined[big] = Share(joined[big].name, joined[big].samples - 1)
                joined.append(Share(dev.name, 1))
                yield _with(stages, {k: replace(st, devices=tuple(left)), to: replace(target, devices=tuple(joined))})


def _with(stages: tuple[Stage, ...], changed: dict[int, Stage]) -> tuple[Stage, ...]:
    return tuple(changed.get(k, st) for k, st in enumerate(stages))
