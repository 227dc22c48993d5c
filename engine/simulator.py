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

from engine.buckets import finish
from engine.costmodel import Workload, link_s, replica_bytes, score
from engine.events import StepEvent
from engine.plan import Plan
from engine.steps import device_steps, stage_actions


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


def simulate(plan: Plan, w: Workload, replicate: bool = False, timeline: bool = True) -> Simulation:
    """One iteration of `plan`; `timeline` False leaves the events out (the planners need only the times)."""
    prediction = score(plan, w)  # validates the plan and gives memory and the closed form
    S = len(plan.stages)
    steps = device_steps(plan, w)
    schedule = stage_actions(plan, steps)
    split = plan.schedule != "1f1b"
    info = {
        name: {
            "stage": d.stage,
            "F": d.forward_s,
            "B": d.backward_s - d.weight_s if split else d.backward_s,
            "W": d.weight_s,
            "send_W": [],
            "send_F": [(t.peer, t.seconds) for t in d.send_forward],
            "send_B": [(t.peer, t.seconds) for t in d.send_backward],
        }
        for name, d in steps.items()
    }
    expected = {}
    for name, d in steps.items():
        expected[(name, "F")] = len(d.recv_forward)
        expected[(name, "B")] = len(d.recv_backward)
    arrivals: dict[tuple[str, str, int], list[float]] = {}
    clock = {name: 0.0 for name in info}
    link = {name: 0.0 for name in info}  # when each device's outgoing link is free
    position = {name: 0 for name in info}
    own_forward_end: dict[tuple[str, int], float] = {}
    last_kind = "W" if split else "B"  # the step that makes the gradients final, as it passes their layers
    last_grad: dict[str, tuple[float, float]] = {}  # device -> its last such step (start, end)
    events: list[StepEvent] = []
    busy = 0.0
    remaining = sum(len(schedule[d["stage"]]) for d in info.values())
    while remaining:
        progressed = False
        for name, d in info.items():
            acts = schedule[d["stage"]]
            while position[name] < len(acts):
                act = acts[position[name]]
                got = arrivals.get((name, act.kind, act.micro_batch), [])
                if act.kind != "W" and len(got) < expected[(name, act.kind)]:
                    break
                ready = max(got, default=0.0)
                if act.kind == "B" and d["stage"] == S - 1:
                    ready = own_forward_end[(name, act.micro_batch)]
                start = max(clock[name], ready)
                end = start + d[act.kind]
                if timeline:
                    events.append(StepEvent(name, d["stage"], act.micro_batch, act.kind, start, end))
                if act.kind == "F":
                    own_forward_end[(name, act.micro_batch)] = end
                elif act.kind == last_kind:
                    last_grad[name] = (start, end)
                t = max(end, link[name])
                for peer, dur in d["send_" + act.kind]:
                    if timeline:
                        events.append(StepEvent(name, d["stage"], act.micro_batch, "send", t, t + dur, peer))
                    t += dur
                    arrivals.setdefault((peer, act.kind, act.micro_batch), []).append(t)
                    link[name] = t  # (busy with sends only: the all-reduce may start before a step ends)
                busy += end - start
                clock[name] = end
                position[name] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulator deadlock: the schedule's dependencies cannot be met")
    for s, st in enumerate(plan.stages):
        names = [x.name for x in st.devices]
        buckets = steps[names[0]].buckets
        for n in names:
            clock[n] = max(clock[n], link[n])
        if buckets:  # each bucket once every device has it, after the sends (engine.buckets)
            free = max(link[n] for n in names)
            ready = [max(a + b.ready * (e - a) for a, e in (last_grad[n] for n in names)) for b in buckets]
            end = finish(free, ready, [b.seconds for b in buckets])
            for n in names:
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
        bubble_fraction=1 - busy / (len(info) * total),  # the share of device time not computing
        memory_bytes=prediction.memory_bytes,
        fits=prediction.fits,
        predicted_iteration_s=prediction.iteration_s,
        events=tuple(events),
    )
