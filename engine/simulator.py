"""Discrete-event simulation of one 1F1B iteration of a plan: per-device timeline, iteration time, bubble.

Step durations come from the cost model's terms (forward, backward, transfers, all-reduce). Each device
runs its stage's 1F1B action list in order on its own slice of every micro-batch. A forward waits for
every input slice from the previous stage, a backward for every gradient slice from the next; after a
step the device sends each neighbour exactly the intersection of their two sample ranges (blocking:
the device is busy while it sends). After its last backward a stage all-reduces its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.costmodel import Workload, allreduce_s, score
from engine.devices import LAYER_OVERHEAD_S
from engine.events import StepEvent
from engine.plan import Plan
from engine.schedule import one_f_one_b


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


def _ranges(stage) -> list[tuple[str, int, int]]:
    """Each device's contiguous slice [lo, hi) of the micro-batch's samples."""
    out, lo = [], 0
    for s in stage.devices:
        out.append((s.name, lo, lo + s.samples))
        lo += s.samples
    return out


def _overlaps(mine: tuple[str, int, int], theirs: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    _, lo, hi = mine
    return [(name, min(hi, b) - max(lo, a)) for name, a, b in theirs if min(hi, b) > max(lo, a)]


def simulate(plan: Plan, w: Workload) -> Simulation:
    prediction = score(plan, w)  # validates the plan and gives memory and the closed form
    cluster, M, S = plan.cluster, plan.micro_batches, len(plan.stages)
    schedule = one_f_one_b(S, M)
    ranges = [_ranges(st) for st in plan.stages]
    # Per device: its stage, slice, step durations, and the transfers after F and after B.
    info = {}
    for s, st in enumerate(plan.stages):
        a_in, a_out = w.boundary_bytes(st.start, st.end)
        layers = st.end - st.start
        for mine in ranges[s]:
            name, lo, hi = mine
            dev, n = cluster.device(name), hi - lo
            send_f = _overlaps(mine, ranges[s + 1]) if s + 1 < S else []
            send_b = _overlaps(mine, ranges[s - 1]) if s > 0 else []
            info[name] = {
                "stage": s,
                "F": layers * LAYER_OVERHEAD_S + n * w.forward(st.start, st.end) / dev.flops_per_s,
                "B": layers * LAYER_OVERHEAD_S + n * w.backward(st.start, st.end) / dev.flops_per_s,
                "send_F": [(peer, cluster.latency_s + x * a_out / cluster.bytes_per_s) for peer, x in send_f],
                "send_B": [(peer, cluster.latency_s + x * a_in / cluster.bytes_per_s) for peer, x in send_b],
            }
    # arrival[(receiver, kind, mb)] = times the slices arrived; complete when every sender delivered.
    expected = {}
    for name, d in info.items():
        s = d["stage"]
        expected[(name, "F")] = len(_overlaps(next(r for r in ranges[s] if r[0] == name), ranges[s - 1])) if s else 0
        expected[(name, "B")] = (
            len(_overlaps(next(r for r in ranges[s] if r[0] == name), ranges[s + 1])) if s + 1 < S else 0
        )
    arrivals: dict[tuple[str, str, int], list[float]] = {}
    clock = {name: 0.0 for name in info}
    position = {name: 0 for name in info}
    own_forward_end: dict[tuple[str, int], float] = {}
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
                if len(got) < expected[(name, act.kind)]:
                    break
                ready = max(got, default=0.0)
                if act.kind == "B" and d["stage"] == S - 1:
                    ready = own_forward_end[(name, act.micro_batch)]
                start = max(clock[name], ready)
                end = start + d[act.kind]
                events.append(StepEvent(name, d["stage"], act.micro_batch, act.kind, start, end))
                if act.kind == "F":
                    own_forward_end[(name, act.micro_batch)] = end
                t = end
                for peer, dur in d["send_" + act.kind]:
                    events.append(StepEvent(name, d["stage"], act.micro_batch, "send", t, t + dur, peer))
                    t += dur
                    arrivals.setdefault((peer, act.kind, act.micro_batch), []).append(t)
                busy += t - start
                clock[name] = t
                position[name] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulator deadlock: the schedule's dependencies cannot be met")
    for s, st in enumerate(plan.stages):
        names = [x.name for x in st.devices]
        ar = allreduce_s(w, cluster, st.start, st.end, len(names))
        if ar > 0:
            start = max(clock[n] for n in names)
            for n in names:
                events.append(StepEvent(n, s, -1, "all-reduce", start, start + ar))
                clock[n] = start + ar
    total = max(clock.values())
    events.sort(key=lambda e: (e.start, e.device))
    return Simulation(
        iteration_s=total,
        throughput=plan.batch_size / total,
        bubble_fraction=1 - busy / (len(info) * total),
        memory_bytes=prediction.memory_bytes,
        fits=prediction.fits,
        predicted_iteration_s=prediction.iteration_s,
        events=tuple(events),
    )
