"""Cost model: time and memory of a stage on a device group, and the one score every plan is judged by.

Per micro-batch, device d of a stage over layers [i, j) computing n samples is busy

    u_d(n) = o + n * c,    o = 2 (j - i) * LAYER_OVERHEAD_S + messages * latency
                           c = (W_fwd + W_bwd)(i, j) / flops_d + (a_in + a_out) / bandwidth

(forward, backward, sending its activations on and its input gradients back; `W` is work in FLOPs
per sample, `a` activation bytes per sample at the stage boundaries). A stage's time is the max over
its devices. A stage of g >= 2 devices ring-all-reduces its gradients once per iteration:
2 (g - 1) / g * params / bandwidth + 2 (g - 1) * latency. Under 1F1B with M micro-batches, S stages:

    iteration = sum_s u_s + (M - 1) * max_s u_s + max_s allreduce_s

which is exactly (M + S - 1)(f + b) for equal stages. Memory of a device in the stage with k stages
after it (itself included): weights + gradients + optimizer state + n * (min(k, M) * saved + peak).

A device whose per-layer seconds are known (`Workload.with_device_times`: a measured table, or the latency
predictor's for a device of no known kind) uses them instead of W / flops_d. A boundary compressed to b bits
(the plan's `compression`) carries a * b / 32 bytes of activations and a * max(b, 8) / 32 of gradients (the
(min, scale) header, at most 1/16 of that, is left out), and each device on it pays encoding and decoding its
values (`codec_work`, measured on the host, turned into device seconds like its compute).

Fault tolerance (replication every K iterations): at a replication point each stage's first device sends
its layers' weights and optimizer state to its neighbour (the next stage's first device, wrapping around)
and to the coordinator, one after the other over its link; the slowest stage's copy adds to that iteration,
K-th of it to the average one. Every device then holds a snapshot of its own layers' weights and optimizer
state, and each stage's neighbour the replica it received. Changes of activations add `delta_memory`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine import schedule
from engine.allocation import StageTerms, stage_time
from engine.devices import LAYER_OVERHEAD_S, Cluster, Device
from engine.errors import UserError
from engine.plan import ALLREDUCE, OFF, Plan, Prediction, Stage, gradient_bits

# FLOP-equivalents to encode and decode one float when no measurement is at hand (about what this host measured).
DEFAULT_CODEC_WORK = 50.0


@dataclass(frozen=True)
class Workload:
    """Device-independent per-layer, per-sample costs of one model (from a profile, or made up in tests)."""

    model: str
    forward_flops: tuple[float, ...]
    backward_flops: tuple[float, ...]
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    optimizer_bytes: tuple[int, ...]
    # Host seconds x the host's FLOP rate (FLOP-equivalents) to encode and decode one float at each compression
    # level (engine.compression), paid by the devices on both ends of a compressed boundary.
    codec_work: tuple[tuple[int, float], ...] = ()
    # Devices (by name) whose per-layer seconds are known (a measured table or the latency predictor's): their
    # forward and backward seconds per sample of each layer, used instead of work / their FLOP rate.
    device_times: Mapping[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    # The share of each layer's backward that computes its weight gradients (the W of a zero-bubble schedule;
    # engine.schedule), as the profile measured it. Empty: half for a layer with parameters, none otherwise.
    weight_share: tuple[float, ...] = ()
    # The bytes of each layer's trained weights: its gradients and its all-reduce (engine.recipe.trained_workload;
    # frozen weights have neither). Empty: every weight is trained.
    trainable_bytes: tuple[int, ...] = ()
    # Bytes of one value crossing an uncompressed cut: 4 (float32), or 2 when the run trains in 16 bits
    # (engine.recipe.trained_workload halves output_bytes then); a compressed cut's codes are the same either way.
    value_bytes: int = 4

    def __post_init__(self) -> None:
        n = len(self.forward_flops)
        for name in ("backward_flops", "output_bytes", "saved_bytes", "peak_bytes", "param_bytes", "optimizer_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"workload {self.model}: {name} has {len(getattr(self, name))} layers, expected {n}")
        if n == 0:
            raise ValueError(f"workload {self.model}: no layers")
        cum = lambda xs: np.concatenate([[0.0], np.cumsum(np.asarray(xs, dtype=float))])  # noqa: E731
        object.__setattr__(self, "_work", cum(np.add(self.forward_flops, self.backward_flops)))
        object.__setattr__(self, "_fwd", cum(self.forward_flops))
        object.__setattr__(self, "_bwd", cum(self.backward_flops))
        ints = lambda xs: [0, *np.cumsum(np.asarray(xs, dtype=np.int64)).tolist()]  # noqa: E731
        object.__setattr__(self, "_saved", ints(self.saved_bytes))
        trained = self.trainable_bytes or self.param_bytes
        if len(trained) != n:
            raise ValueError(f"workload {self.model}: trainable_bytes has {len(trained)} layers, expected {n}")
        static = np.add(self.param_bytes, trained) + np.asarray(self.optimizer_bytes)  # weights, gradients, state
        object.__setattr__(self, "_static", ints(static))
        object.__setattr__(self, "_params", ints(trained))
        object.__setattr__(self, "work_prefix", self._work.tolist())
        tables = {}
        for name, (fwd, bwd) in self.device_times.items():
            if len(fwd) != n or len(bwd) != n:
                raise ValueError(f"workload {self.model}: device {name!r} has times for {len(fwd)}/{len(bwd)} layers")
            finite = all(math.isfinite(t) and t >= 0 for t in (*fwd, *bwd))
            if not finite or not all(f + b > 0 for f, b in zip(fwd, bwd)):
                raise ValueError(f"workload {self.model}: device {name!r} needs finite, positive times for every layer")
            tables[name] = (cum(fwd).tolist(), cum(bwd).tolist(), cum(np.add(fwd, bwd)).tolist())
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_codec", dict(self.codec_work))
        share = self.weight_share or tuple(0.5 if p > 0 else 0.0 for p in self.param_bytes)
        if len(share) != n or not all(0.0 <= x <= 1.0 for x in share):
            raise ValueError(f"workload {self.model}: weight_share needs a share in [0, 1] for each of {n} layers")
        object.__setattr__(self, "_share", np.asarray(share, dtype=float))
        object.__setattr__(self, "_fractions", {})  # weight_fraction's answers: the simulator asks again and again

    @property
    def num_layers(self) -> int:
        return len(self.forward_flops)

    def work(self, i: int, j: int) -> float:
        """Forward + backward FLOPs per sample of layers [i, j)."""
        return float(self._work[j] - self._work[i])

    def forward(self, i: int, j: int) -> float:
        return float(self._fwd[j] - self._fwd[i])

    def backward(self, i: int, j: int) -> float:
        return float(self._bwd[j] - self._bwd[i])

    def compute_s(self, dev: Device, i: int, j: int) -> float:
        """Forward + backward seconds per sample of layers [i, j) on `dev`."""
        table = self._tables.get(dev.name)
        if table is None:
            return self.work(i, j) / dev.flops_per_s
        return table[2][j] - table[2][i]

    def forward_s(self, dev: Device, i: int, j: int) -> float:
        table = self._tables.get(dev.name)
        return self.forward(i, j) / dev.flops_per_s if table is None else table[0][j] - table[0][i]

    def backward_s(self, dev: Device, i: int, j: int) -> float:
        table = self._tables.get(dev.name)
        return self.backward(i, j) / dev.flops_per_s if table is None else table[1][j] - table[1][i]

    def weight_fraction(self, dev: Device, i: int, j: int) -> float:
        """The share of `dev`'s backward over layers [i, j) that computes weight gradients."""
        table = self._tables.get(dev.name)
        key = (None if table is None else dev.name, i, j)
        if key not in self._fractions:
            bwd = np.asarray(self.backward_flops[i:j] if table is None else np.diff(table[1][i : j + 1]), dtype=float)
            total = float(bwd.sum())
            self._fractions[key] = float(bwd @ self._share[i:j]) / total if total > 0 else 0.0
        return self._fractions[key]

    def speed_bound(self, dev: Device) -> float:
        """A FLOP rate `dev` never beats on any layer range (work / it <= compute_s): its own rate, or for a
        device with a table the best work per second of any of its layers. The planner's bounds rely on it."""
        table = self._tables.get(dev.name)
        if table is None:
            return dev.flops_per_s
        rates = np.diff(self._work) / np.diff(table[2])
        return max(float(rates.max()), 1e-30) * (1 + 1e-9)  # headroom for rounding in the prefix sums

    def table_key(self, dev: Device) -> tuple | None:
        """What, besides its spec, makes a device's times differ from another's (its table, if it has one)."""
        table = self._tables.get(dev.name)
        return None if table is None else tuple(table[2])

    def codec_s(self, dev: Device, floats: float, bits: int) -> float:
        """Seconds `dev` spends encoding and decoding `floats` values at compression level `bits` (0 when off)."""
        if bits >= OFF or floats <= 0:
            return 0.0
        work = self._codec.get(bits, DEFAULT_CODEC_WORK) * floats
        table = self._tables.get(dev.name)
        if table is None:
            return work / dev.flops_per_s
        total = table[2][-1]
        return work / (self._work[-1] / total) if total > 0 else 0.0

    def with_device_times(self, times: Mapping[str, tuple[Sequence[float], Sequence[float]]]) -> Workload:
        """This workload, with the named devices' per-layer forward and backward seconds per sample."""
        merged = dict(self.device_times)
        merged.update({k: (tuple(map(float, f)), tuple(map(float, b))) for k, (f, b) in times.items()})
        return replace(self, device_times=merged)

    def saved(self, i: int, j: int) -> int:
        return self._saved[j] - self._saved[i]

    def static_bytes(self, i: int, j: int) -> int:
        """Weights + gradients + optimizer state of layers [i, j)."""
        return self._static[j] - self._static[i]

    def wire(self, nbytes: float, bits: int) -> float:
        """Bytes on the wire of a cut that holds `nbytes` uncompressed, at compression level `bits`."""
        return nbytes if bits >= OFF else nbytes * bits / (8 * self.value_bytes)

    def values(self, nbytes: float) -> float:
        """How many values a cut of `nbytes` (uncompressed) holds: what a codec encodes."""
        return nbytes / self.value_bytes

    def params(self, i: int, j: int) -> int:
        """Bytes of the trained weights of layers [i, j) (what their all-reduce sends)."""
        return self._params[j] - self._params[i]

    def peak(self, i: int, j: int) -> int:
        return max(self.peak_bytes[i:j])

    def boundary_bytes(self, i: int, j: int) -> tuple[int, int]:
        """Activation bytes per sample entering and leaving a stage over [i, j)."""
        a_in = self.output_bytes[i - 1] if i > 0 else 0
        a_out = self.output_bytes[j - 1] if j < self.num_layers else 0
        return a_in, a_out

    @classmethod
    def from_profile(cls, profile) -> Workload:
        """Turn a host profile into FLOP-equivalent work: the host's measured time shape, scaled by FLOPs.

        Each layer's work is its measured host time times the host's average FLOP/s on this model, so
        layers that run below the average rate (depthwise convs, norms) cost what they really cost,
        while the model's total stays its FLOP count. Devices then turn work into seconds by their speed.
        """
        layers = profile.layers
        host_s = sum(lp.forward_s + lp.backward_s for lp in layers)
        flops = sum(lp.flops for lp in layers)
        rate = flops / host_s if host_s > 0 else 1.0
        return cls(
            model=profile.model,
            forward_flops=tuple(lp.forward_s * rate for lp in layers),
            backward_flops=tuple(lp.backward_s * rate for lp in layers),
            output_bytes=tuple(int(lp.output_bytes) for lp in layers),
            saved_bytes=tuple(int(lp.saved_bytes) for lp in layers),
            peak_bytes=tuple(int(lp.peak_bytes) for lp in layers),
            param_bytes=tuple(int(lp.param_bytes) for lp in layers),
            optimizer_bytes=tuple(int(lp.optimizer_bytes) for lp in layers),
            weight_share=tuple(min(1.0, lp.weight_s / lp.backward_s) if lp.backward_s > 0 else 0.0 for lp in layers),
        )


def link_s(cluster: Cluster, nbytes: float, *ends: str) -> float:
    """One message of `nbytes` between the devices `ends` (none: any two of the cluster's default links): latency
    + bytes / the slower end's bandwidth."""
    return cluster.latency_s + nbytes / cluster.bytes_per_s_of(*ends)


def ring_allreduce_s(cluster: Cluster, nbytes: float, group: int, names: tuple[str, ...] = ()) -> float:
    """Ring all-reduce of `nbytes` across `group` devices: 2 (g - 1) / g * bytes / bandwidth + 2 (g - 1) latency,
    the bandwidth of the ring's slowest link (of `names`, the group's devices, when given)."""
    if group < 2:
        return 0.0
    return 2 * (group - 1) / group * nbytes / cluster.bytes_per_s_of(*names) + 2 * (group - 1) * cluster.latency_s


def stage_fixed_s(cluster: Cluster, layers: int, boundaries: int) -> float:
    """A device's per-micro-batch cost that does not grow with its samples: each layer's launch overhead in
    the forward and the backward, and one message latency each way over each of the stage's `boundaries`
    (0, 1 or 2 neighbouring stages). Linear in both, which the planner's bounds rely on."""
    return 2 * layers * LAYER_OVERHEAD_S + 2 * boundaries * cluster.latency_s


def boundary_s(w: Workload, cluster: Cluster, dev: Device, i: int, j: int, levels: tuple[int, int]) -> float:
    """Per-sample seconds a device of the stage over [i, j) spends on its boundaries: its activations and
    gradients on the links, at `levels` (bits in, bits out) of their uncompressed size, and encoding and decoding
    them (both directions) when compressed."""
    a_in, a_out = w.boundary_bytes(i, j)
    b_in, b_out = levels
    rate = cluster.link_mbps_of(dev) * 1e6 / 8  # over its own link
    if b_in >= OFF and b_out >= OFF:
        return (a_in + a_out) / rate
    wire = w.wire(a_in, gradient_bits(b_in)) + w.wire(a_out, b_out)  # it sends activations on and gradients back
    return wire / rate + w.codec_s(dev, w.values(a_in), b_in) + w.codec_s(dev, w.values(a_out), b_out)


def stage_terms(
    w: Workload, cluster: Cluster, dev: Device, i: int, j: int, in_flight: int, levels: tuple[int, int] = (OFF, OFF)
) -> StageTerms:
    fixed = stage_fixed_s(cluster, j - i, (i > 0) + (j < w.num_layers))
    per_sample = w.compute_s(dev, i, j) + boundary_s(w, cluster, dev, i, j, levels)
    per_sample = max(per_sample, 1e-15)  # a stage of free layers (flatten) still takes a sample
    per_mem = in_flight * w.saved(i, j) + w.peak(i, j)
    free = dev.memory_bytes - w.static_bytes(i, j)
    cap = 0 if free < 0 else (free // per_mem if per_mem > 0 else 1 << 30)
    return StageTerms(fixed, per_sample, int(cap))


def stage_terms_grid(w: Workload, cluster: Cluster, dev: Device, in_flight: int) -> tuple[np.ndarray, ...]:
    """`stage_terms` (boundaries uncompressed) of every layer range at once: the fixed and per-sample seconds and the
    sample cap, as (L + 1) x (L + 1) arrays indexed [i, j]; the same numbers where i < j, meaningless elsewhere."""
    L = w.num_layers
    i, j = np.ogrid[: L + 1, : L + 1]
    fixed = 2 * (j - i) * LAYER_OVERHEAD_S + 2 * ((i > 0).astype(np.int64) + (j < L)) * cluster.latency_s
    table = w._tables.get(dev.name)
    prefix = np.asarray(table[2]) if table else w._work
    compute = prefix[j] - prefix[i] if table else (prefix[j] - prefix[i]) / dev.flops_per_s
    out = np.asarray(w.output_bytes, dtype=np.int64)
    a_in = np.concatenate([[0], out])[i]  # the output of layer i - 1 (none before the first)
    a_out = np.concatenate([[0], out[:-1], [0]])[j]  # the output of layer j - 1 (none after the last)
    per = np.maximum(compute + (a_in + a_out) / (cluster.link_mbps_of(dev) * 1e6 / 8), 1e-15)
    saved, static = np.asarray(w._saved, dtype=np.int64), np.asarray(w._static, dtype=np.int64)
    peak = np.zeros((L + 1, L + 1), dtype=np.int64)
    for a in range(L):  # the most of any layer of [a, b)
        peak[a, a + 1 :] = np.maximum.accumulate(np.asarray(w.peak_bytes[a:], dtype=np.int64))
    per_mem = in_flight * (saved[j] - saved[i]) + peak
    free = dev.memory_bytes - (static[j] - static[i])
    cap = np.where(free < 0, 0, np.where(per_mem > 0, free // np.maximum(per_mem, 1), 1 << 30))
    return fixed, per, cap


def device_memory(w: Workload, i: int, j: int, in_flight: int, samples: int) -> int:
    """Bytes a device uses running `samples` of each micro-batch through layers [i, j)."""
    return w.static_bytes(i, j) + samples * (in_flight * w.saved(i, j) + w.peak(i, j))


def allreduce_s(
    w: Workload, cluster: Cluster, i: int, j: int, group: int, allreduce: str = "off", names: tuple[str, ...] = ()
) -> float:
    """Ring all-reduce of the stage's gradients across `group` devices (`names`, when known: the ring runs at its
    slowest link), in the `allreduce` wire format (engine.plan.ALLREDUCE: float32, or 16-bit floats at half)."""
    return ring_allreduce_s(cluster, w.params(i, j) * ALLREDUCE[allreduce] / 4, group, names)


def iteration_time(stage_times: list[float], allreduces: list[float], micro_batches: int) -> float:
    return sum(stage_times) + (micro_batches - 1) * max(stage_times) + max(allreduces)


def replica_bytes(w: Workload, i: int, j: int) -> int:
    """The bytes a replica of layers [i, j) takes: their weights and optimizer state."""
    return w.static_bytes(i, j) - w.params(i, j)  # weights + gradients + optimizer state, less the gradients


def replication_s(plan: Plan, w: Workload) -> float:
    """Device seconds one replication point adds to its iteration: the slowest stage's two copies (to the
    neighbour and to the coordinator; one-stage plans only the latter) or the largest replica received."""
    copies = 2 if len(plan.stages) > 1 else 1
    # each stage's first device sends the copies, over its own link
    return max(
        copies * link_s(plan.cluster, replica_bytes(w, st.start, st.end), st.devices[0].name) for st in plan.stages
    )


def replication_memory(plan: Plan, w: Workload) -> dict[str, int]:
    """The bytes each device holds for fault tolerance: a snapshot of its own layers and, on each stage's
    neighbour, the replica of the stage before it."""
    held = {}
    S = len(plan.stages)
    for s, st in enumerate(plan.stages):
        for d in st.devices:
            held[d.name] = replica_bytes(w, st.start, st.end)
        if S > 1:
            prev = plan.stages[(s - 1) % S]
            held[st.devices[0].name] += replica_bytes(w, prev.start, prev.end)
    return held


def delta_memory(plan: Plan, w: Workload) -> dict[str, int]:
    """The most bytes each device keeps for activation-change compression (engine.deltas): per peer across a
    compressed boundary, `delta_samples` activations in bfloat16 and as many that the last iterations replaced."""
    held = dict.fromkeys(plan.device_names, 0)
    for b in (b for b in range(len(plan.stages) - 1) if plan.delta and plan.level(b) < OFF):
        each = 2 * plan.delta_samples * (w.output_bytes[plan.stages[b].end - 1] // 2)
        ends = [list(itertools.accumulate((0, *(s.samples for s in plan.stages[b + i].devices)))) for i in (0, 1)]
        for i, a in enumerate(plan.stages[b].devices):
            for j, c in enumerate(plan.stages[b + 1].devices):
                if max(ends[0][i], ends[1][j]) < min(ends[0][i + 1], ends[1][j + 1]):  # their samples meet
                    held[a.name], held[c.name] = held[a.name] + each, held[c.name] + each
    return held


def score(plan: Plan, w: Workload, replicate_every: int = 0, memo: dict | None = None) -> Prediction:
    """Predicted iteration time, throughput, bubble fraction and memory of any plan (fits or not); with
    `replicate_every` K > 0, the average iteration and the memory include replication (see the top). `memo`: a dict
    shared by calls on plans of one workload and cluster, where a stage met before is not worked out again."""
    plan.validate(w.num_layers)
    if plan.model != w.model:
        raise UserError(f"plan is for model {plan.model!r} but the workload is {w.model!r}")
    cluster, M, S = plan.cluster, plan.micro_batches, len(plan.stages)
    times, reduces, memory, busy, fits = [], [], {}, 0.0, True
    for p, st in enumerate(plan.stages):
        held = schedule.in_flight(S, M, p, plan.schedule)
        levels = (plan.level(p - 1) if p else OFF, plan.level(p))
        key = ("score", st, held, levels, plan.allreduce)
        found = None if memo is None else memo.get(key)
        if found is None:
            found = _stage_score(plan, w, st, held, levels)
            if memo is not None:
                memo[key] = found
        time, reduce, used, stage_fits, works = found
        times.append(time)
        reduces.append(reduce)
        memory.update(used)
        fits &= stage_fits
        for work in works:
            busy += M * work
    total = iteration_time(times, reduces, M)
    for name, extra in delta_memory(plan, w).items():
        memory[name] += extra
        fits &= memory[name] <= cluster.device(name).memory_bytes
    if replicate_every > 0:
        total += replication_s(plan, w) / replicate_every
        for name, extra in replication_memory(plan, w).items():
            memory[name] += extra
        fits = all(b <= cluster.device(n).memory_bytes for n, b in memory.items())
    bubble = 1 - busy / (len(memory) * total)
    return Prediction(total, plan.batch_size / total, bubble, memory, fits)


def _stage_score(plan: Plan, w: Workload, st: Stage, held: int, levels: tuple[int, int]) -> tuple:
    """`score`'s part of one stage: (time, all-reduce, each device's bytes, whether they fit, each device's seconds a
    micro-batch)."""
    cluster = plan.cluster
    terms = [stage_terms(w, cluster, cluster.device(s.name), st.start, st.end, held, levels) for s in st.devices]
    names = tuple(d.name for d in st.devices)
    used = {s.name: device_memory(w, st.start, st.end, held, s.samples) for s in st.devices}
    return (
        stage_time(terms, [s.samples for s in st.devices]),
        allreduce_s(w, cluster, st.start, st.end, len(st.devices), plan.allreduce, names),
        used,
        all(used[n] <= cluster.device(n).memory_bytes for n in names),
        [t.fixed + s.samples * t.per_sample for t, s in zip(terms, st.devices)],
    )


def ideal_throughput(w: Workload, cluster: Cluster) -> float:
    """Sum of every device's own training throughput (whole model, no communication, no memory limit)."""
    return sum(1 / w.compute_s(d, 0, w.num_layers) for d in cluster.devices)
