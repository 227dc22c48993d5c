"""Discrete-event simulation of one iteration of a plan: per-device timeline, iteration time, bubble.

Step durations come from engine.steps (the cost model's terms: forward, backward, transfers, all-reduce),
the same numbers the emulated runtime pads to. Each device runs its stage's action list under the plan's
schedule (engine.schedule: 1F1B, or a zero-bubble one whose B is the input gradient and W the weight
gradient, run later) in order on its own slice of every micro-batch. A forward waits for every input slice
from the previous stage, a backward for every gradient slice from the next; after a step the device sends
each neighbour exactly the intersection of their two sample ranges. Sends do not hold the device up (as in
the runtime): they queue on its outgoing link, one at a time, while it computes on. A stage all-reduces its
gradients in buckets (engine.buckets) as its devices' last gradient step (backward or W) makes them final,
once their links are done with the sends. An iteration that ends at a replication point (`replicate`) then has
each stage's first device copy its layers to its neighbour and to the coordinator, as the runtime does once
every device has committed the iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import simkernel
from engine.buckets import finish
from engine.costmodel import Workload, link_s, replica_bytes, score
from engine.events import StepEvent
from engine.plan import Plan
from engine.schedule import KINDS
from engine.steps import device_steps, stage_codes


@dataclass(frozen=True)
class Simulation:
    """What one simulated iteration did."""

    iteration_s: float
    throughput: float
    bubble_fraction: float
    memory_bytes: dict[str, int]
    fits: bool
    predicted_iteration_s: float  # the cost model's closed form, for comparison
    events: tuple[StepEvent, ...]

    def to_dict(self, with_events: bool = False) -> dict:
        doc = {
            "iteration_s": self.iteration_s,
            "throughput": self.throughput,
            "bubble_fraction": self.bubble_fraction,
            "memory_bytes": dict(self.memory_bytes),
            "fits": self.fits,
            "predicted_iteration_s": self.predicted_iteration_s,
        }
        if with_events:
            doc["events"] = [e.to_dict() for e in self.events]
        return doc


def simulate(
    plan: Plan,
    w: Workload,
    replicate: bool = False,
    timeline: bool = True,
    *,
    known: tuple | None = None,
    memo: dict | None = None,
) -> Simulation:
    """One iteration of `plan`; `timeline` False leaves the events out (the planners need only the times).
    `known`: the plan's (`score`, `device_steps`), where the caller has them already; else they are worked out, with
    `memo` (see `steps.device_steps`)."""
    # score validates the plan and gives memory and the closed form
    prediction, steps = known if known is not None else (score(plan, w, memo=memo), device_steps(plan, w, memo))
    S, M = len(plan.stages), plan.micro_batches
    kinds, mbs = stage_codes(plan, steps)
    split = plan.schedule != "1f1b"
    names = list(steps)
    index = {name: k for k, name in enumerate(names)}
    sends = [(d.send_forward, d.send_backward) for d in steps.values()]
    transfers = [t for pair in sends for kind in pair for t in kind]
    at = np.cumsum([0, *(len(kind) for pair in sends for kind in pair)])  # device d's F sends, then its B sends
    durations = [
        (d.forward_s, d.backward_s - d.weight_s if split else d.backward_s, d.weight_s) for d in steps.values()
    ]
    clock_, link_, last_, busy, log_i, log_t, starts = simkernel.run(
        np.array([d.stage for d in steps.values()], np.int64), np.array(durations), kinds, mbs, M,
        np.array([(len(d.recv_forward), len(d.recv_backward)) for d in steps.values()], np.int64),
        np.column_stack([at[0:-1:2], at[1::2], at[2::2]]),
        np.array([index[t.peer] for t in transfers], np.int64), np.array([t.seconds for t in transfers]),
        simkernel.W if split else simkernel.B,
    )  # fmt: skip
    if len(log_i) < len(names) * kinds.shape[1]:
        raise RuntimeError("simulator deadlock: the schedule's dependencies cannot be met")
    events: list[StepEvent] = []
    if timeline:  # each step, then its sends, in the order they ran
        x, starts = 0, starts.tolist()
        for (d, k, mb), (start, end) in zip(log_i.tolist(), log_t.tolist()):
            name, stage = names[d], steps[names[d]].stage
            events.append(StepEvent(name, stage, mb, KINDS[k], start, end))
            for t in sends[d][k] if k != simkernel.W else ():
                events.append(StepEvent(name, stage, mb, "send", starts[x], starts[x] + t.seconds, t.peer))
                x += 1
    clock = dict(zip(names, clock_.tolist()))
    link = dict(zip(names, link_.tolist()))
    last_grad = {name: (a, e) for name, (a, e) in zip(names, last_.tolist())}
    for s, st in enumerate(plan.stages):
        group = [x.name for x in st.devices]
        buckets = steps[group[0]].buckets
        for n in group:
            clock[n] = max(clock[n], link[n])
        if buckets:  # each bucket once every device has it, after the sends (engine.buckets)
            free = max(link[n] for n in group)
            ready = [max(a + b.ready * (e - a) for a, e in (last_grad[n] for n in group)) for b in buckets]
            end = finish(free, ready, [b.seconds for b in buckets])
            for n in group:
                events.append(StepEvent(n, s, -1, "all-reduce", max(free, ready[0]), end))
                clock[n] = max(clock[n], end)
    total = max(clock.values())
    if replicate:  # after the commit each stage's first device copies its layers to the neighbour and coordinator
        copies = 2 if S > 1 else 1
        for s, st in enumerate(plan.stages):
            first = st.devices[0].name
            seconds = copies * link_s(plan.cluster, replica_bytes(w, st.start, st.end), first)
            if S > 1:  # it also receives the previous stage's replica (from that stage's first device)
                prev = plan.stages[s - 1]
                seconds = max(
                    seconds, link_s(plan.cluster, replica_bytes(w, prev.start, prev.end), prev.devices[0].name, first)
                )
            events.append(StepEvent(first, s, -1, "send", total, total + seconds, "replica"))
            clock[first] = total + seconds
        total = max(clock.values())
    events = sorted(events, key=lambda e: (e.start, e.device)) if timeline else []
    return Simulation(
        iteration_s=total,
        throughput=plan.batch_size / total,
        bubble_fraction=1 - busy / (len(names) * total),  # the share of device time not computing
        memory_bytes=prediction.memory_bytes,
        fits=prediction.fits,
        predicted_iteration_s=prediction.iteration_s,
        events=tuple(events),
    )
