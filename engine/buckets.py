"""The stage all-reduce in buckets during the last backward: which layers' gradients each bucket holds, how far
into a device's last gradient step they are final, and when the stage's ring has summed them all.

A stage of g >= 2 devices sums its gradients once per iteration. They are final as its last gradient step (the
last micro-batch's backward under 1F1B, its weight step W under a zero-bubble schedule) passes their layers, last
layer first. A bucket of layers goes on the ring once every device has it and the bucket before it is done:

    end_0 = when every device's link is free,    end_k = max(end_(k-1), ready_k) + ring_k

`ready_k`: when the last device to have bucket k has it; `ring_k`: the ring all-reduce of its bytes, its own
latency included (engine.costmodel.ring_allreduce_s). The simulator times the stage all-reduce so, and the
runtime sends each bucket as its gradients are final and pads an emulated device to the same end. The bucket
size is, of `SIZES`, the one whose ring ends first on the stage's slowest device; one bucket is what the cost
model's closed form charges (after the step), so buckets only take time off it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.costmodel import Workload, ring_allreduce_s
from engine.devices import Cluster, Device
from engine.plan import ALLREDUCE

# Bytes on the wire a bucket holds at least (the last one: what is left); 0: the whole stage in one.
SIZES = (0, 16 * 2**20, 4 * 2**20, 2**20)


@dataclass(frozen=True)
class Bucket:
    """The gradients of layers [start, end) of the model: final `ready` of the way through the device's last
    gradient step, and `seconds` (device seconds) on the stage's ring."""

    start: int
    end: int
    ready: float
    seconds: float


def finish(start: float, ready: Sequence[float], seconds: Sequence[float]) -> float:
    """When the ring has summed every bucket: each once it is ready everywhere and the one before is done."""
    end = start
    for r, s in zip(ready, seconds, strict=True):
        end = max(end, r) + s
    return end


def stage_buckets(
    w: Workload,
    cluster: Cluster,
    dev: Device,
    i: int,
    j: int,
    names: tuple[str, ...],
    allreduce: str,
    step_s: float,
    weights_only: bool,
) -> tuple[Bucket, ...]:
    """The buckets of the stage over layers [i, j) on devices `names`, last layers first (none for one device).
    `dev`: its slowest device, whose last gradient step takes `step_s`; `weights_only`: that step computes the
    weight gradients alone (a zero-bubble W), else the whole backward."""
    g = len(names)
    if g < 2:
        return ()
    work = [w.backward_s(dev, k, k + 1) * (w.weight_fraction(dev, k, k + 1) if weights_only else 1.0)
            for k in range(i, j)]  # fmt: skip
    total = sum(work)
    done, passed = {}, 0.0  # layer -> the share of the step done once it is passed (from the last layer down)
    for k in range(j - 1, i - 1, -1):
        passed += work[k - i]
        done[k] = passed / total if total > 0 else 1.0
    done[i] = 1.0
    wire = [w.params(k, k + 1) * ALLREDUCE[allreduce] / 4 for k in range(i, j)]  # trained weights
    best: tuple[float, tuple[Bucket, ...]] | None = None
    for size in SIZES:
        buckets, top, held = [], j, 0.0
        for k in range(j - 1, i, -1):
            held += wire[k - i]
            if size and held >= size:
                buckets.append(Bucket(k, top, done[k], ring_allreduce_s(cluster, held, g, names)))
                top, held = k, 0.0
        held += wire[0]
        if held > 0 or not buckets:
            buckets.append(Bucket(i, top, 1.0, ring_allreduce_s(cluster, held, g, names)))
        else:  # layers left without parameters: the bucket before takes them (it holds the same bytes)
            last = buckets.pop()
            buckets.append(Bucket(i, last.end, last.ready, last.seconds))
        end = finish(0.0, [b.ready * step_s for b in buckets], [b.seconds for b in buckets])
        if best is None or end < best[0] - 1e-12:
            best = (end, tuple(buckets))
    return best[1]
