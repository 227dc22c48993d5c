"""Per-device step durations of a plan in device seconds, shared by the simulator and the emulated runtime.

Device i of a stage holds the contiguous slice [lo, hi) of every micro-batch's samples (by its share);
it sends device j of the next stage exactly the intersection of their two slices, and gets the
gradients of that intersection back.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.buckets import Bucket, stage_buckets
from engine.costmodel import Workload, allreduce_s, link_s
from engine.devices import LAYER_OVERHEAD_S
from engine.plan import OFF, Plan, Stage, gradient_bits
from engine.schedule import Action, StageTimes, actions, codes, one_f_one_b


@dataclass(frozen=True)
class Transfer:
    """A slice [lo, hi) of the micro-batch exchanged with `peer`, and its duration in device seconds."""

    peer: str
    lo: int
    hi: int
    seconds: float


@dataclass(frozen=True)
class DeviceSteps:
    """What one device does per micro-batch, and how long each step takes on the real device."""

    name: str
    stage: int
    lo: int  # this device's slice [lo, hi) of each micro-batch
    hi: int
    forward_s: float
    backward_s: float
    # The part of backward_s that computes weight gradients: the W step where the schedule splits the backward
    # (engine.schedule); all of it on the first stage, which sends no gradient back.
    weight_s: float
    send_forward: tuple[Transfer, ...]  # activations to the next stage, after each F
    send_backward: tuple[Transfer, ...]  # input gradients to the previous stage, after each B
    recv_forward: tuple[Transfer, ...]  # activation slices from the previous stage, before each F
    recv_backward: tuple[Transfer, ...]  # gradient slices from the next stage, before each B
    allreduce_s: float  # the stage's gradient all-reduce, once per iteration (0 for a one-device stage)
    # ... in buckets during the device's last gradient step (engine.buckets; none for a one-device stage)
    buckets: tuple[Bucket, ...] = ()

    @property
    def samples(self) -> int:
        return self.hi - self.lo


def slices(stage: Stage) -> list[tuple[str, int, int]]:
    """Each device's contiguous slice [lo, hi) of the micro-batch's samples, in the stage's order."""
    out, lo = [], 0
    for s in stage.devices:
        out.append((s.name, lo, lo + s.samples))
        lo += s.samples
    return out


def overlaps(lo: int, hi: int, theirs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The devices of `theirs` whose slice meets [lo, hi), with the common part."""
    return [(name, max(lo, a), min(hi, b)) for name, a, b in theirs if min(hi, b) > max(lo, a)]


def device_steps(plan: Plan, w: Workload, memo: dict | None = None) -> dict[str, DeviceSteps]:
    """Every device's steps, by name, in plan order. `memo`: a dict shared by calls on plans of one workload and
    cluster (a planner's candidates, most a move apart): a stage met before with the same layers, shares,
    neighbours' shares, boundary levels, all-reduce format and schedule kind is not worked out again."""
    S = len(plan.stages)
    ranges = [slices(st) for st in plan.stages]
    out = {}
    for s, st in enumerate(plan.stages):
        before = (plan.stages[s - 1].devices, plan.level(s - 1)) if s else None
        after = plan.stages[s + 1].devices if s + 1 < S else None
        key = ("steps", s, st, before, after, plan.level(s), plan.allreduce, plan.schedule != "1f1b")
        found = None if memo is None else memo.get(key)
        if found is None:
            found = _stage_steps(plan, w, s, ranges)
            if memo is not None:
                memo[key] = found
        for d in found:
            out[d.name] = d
    return out


def _stage_steps(plan: Plan, w: Workload, s: int, ranges: list[list[tuple[str, int, int]]]) -> list[DeviceSteps]:
    """The steps of stage s's devices (`ranges`: every stage's `slices`)."""
    cluster, S, st = plan.cluster, len(plan.stages), plan.stages[s]
    a_in, a_out = w.boundary_bytes(st.start, st.end)
    b_in, b_out = (plan.level(s - 1) if s else OFF), plan.level(s)
    layers = st.end - st.start
    names = tuple(d.name for d in st.devices)
    reduce = allreduce_s(w, cluster, st.start, st.end, len(st.devices), plan.allreduce, names)

    def moves(name: str, lo: int, hi: int, other: int, nbytes: float) -> tuple[Transfer, ...]:
        if not 0 <= other < S:
            return ()
        return tuple(
            Transfer(peer, a, b, link_s(cluster, (b - a) * nbytes, name, peer))  # at the slower end's rate
            for peer, a, b in overlaps(lo, hi, ranges[other])
        )

    stage: dict[str, dict] = {}  # each device's fields, until the stage's buckets are known
    for name, lo, hi in ranges[s]:
        dev, n = cluster.device(name), hi - lo
        # Half of a compressed boundary's codec time falls in the forward (activations), half in the backward.
        codec = (w.codec_s(dev, w.values(a_in), b_in) + w.codec_s(dev, w.values(a_out), b_out)) / 2
        backward = layers * LAYER_OVERHEAD_S + n * (w.backward_s(dev, st.start, st.end) + codec)
        stage[name] = dict(
            name=name,
            stage=s,
            lo=lo,
            hi=hi,
            forward_s=layers * LAYER_OVERHEAD_S + n * (w.forward_s(dev, st.start, st.end) + codec),
            backward_s=backward,
            weight_s=backward if s == 0 else backward * w.weight_fraction(dev, st.start, st.end),
            send_forward=moves(name, lo, hi, s + 1, w.wire(a_out, b_out)),
            send_backward=moves(name, lo, hi, s - 1, w.wire(a_in, gradient_bits(b_in))),
            recv_forward=moves(name, lo, hi, s - 1, w.wire(a_in, b_in)),
            recv_backward=moves(name, lo, hi, s + 1, w.wire(a_out, gradient_bits(b_out))),
            allreduce_s=reduce,
        )
    # the last gradient step: the last micro-batch's W under a zero-bubble schedule, else its backward
    split = plan.schedule != "1f1b"
    last = [(stage[name]["weight_s"] if split else stage[name]["backward_s"], name) for name in names]
    step_s, slowest = max(last)
    buckets = stage_buckets(w, cluster, cluster.device(slowest), st.start, st.end, names, plan.allreduce, step_s,
                            weights_only=split and s > 0)  # fmt: skip
    return [DeviceSteps(**stage[name], buckets=buckets) for name in names]


def stage_actions(plan: Plan, steps: dict[str, DeviceSteps]) -> dict[int, list[Action]]:
    """Every stage's action list under the plan's schedule; a zero-bubble one is built from each stage's slowest
    device's step times, so every process that has the plan's steps builds the same lists."""
    if plan.schedule == "1f1b":
        return one_f_one_b(len(plan.stages), plan.micro_batches)
    return actions(*stage_codes(plan, steps))


def stage_codes(plan: Plan, steps: dict[str, DeviceSteps]):
    """`stage_actions` as `engine.schedule.codes`' arrays (kinds, micro-batches), for the simulator."""
    S, M = len(plan.stages), plan.micro_batches
    if plan.schedule == "1f1b":
        return codes(S, M, "1f1b")
    times = []
    for st in plan.stages:
        ds = [steps[d.name] for d in st.devices]
        times.append(
            StageTimes(
                forward=max(d.forward_s for d in ds),
                backward=max(d.backward_s - d.weight_s for d in ds),
                weight=max(d.weight_s for d in ds),
                send_forward=max(sum(t.seconds for t in d.send_forward) for d in ds),
                send_backward=max(sum(t.seconds for t in d.send_backward) for d in ds),
            )
        )
    return codes(S, M, plan.schedule, times)
