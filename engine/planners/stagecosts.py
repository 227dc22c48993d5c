"""Stage times for the compiled search (engine.planners.kernel): the cost model's arithmetic over prefix tables.

The same expressions, in the same order, as `costmodel.stage_terms`, `allocation.allocate`, `costmodel.allreduce_s`
and the closed-form split of `asteroid` documents, so compiled and Python agree to the last bit; `tables` builds
the arrays once per micro-batch count.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit

from engine.allocation import water_fill
from engine.costmodel import DEFAULT_CODEC_WORK
from engine.devices import LAYER_OVERHEAD_S
from engine.plan import ALLREDUCE, OFF, gradient_bits

NO_CAP = 1 << 30  # "no memory limit" in sample counts, as in engine.costmodel.stage_terms

_water_fill = njit(cache=True)(water_fill)  # allocation.allocate's split, compiled


@njit(cache=True)
def per_sample(t, k, i, j):
    """Seconds per sample of class k on layers [i, j): compute and its boundaries (costmodel.stage_terms)."""
    compute = (t.prefix[k, j] - t.prefix[k, i]) / t.divisor[k]
    a_in = t.out[i - 1] if i > 0 else 0
    a_out = t.out[j - 1] if j < t.L else 0
    if t.off:
        edge = (a_in + a_out) / t.rate[k]
    else:
        edge = (a_in * t.gbits + a_out * t.bits) / (8 * t.vbytes) / t.rate[k]  # (Workload.wire)
        if t.codec_div[k] > 0:  # encoding and decoding both directions (Workload.codec_s)
            if a_in > 0:
                edge += t.codec * (a_in / t.vbytes) / t.codec_div[k]
            if a_out > 0:
                edge += t.codec * (a_out / t.vbytes) / t.codec_div[k]
    value = compute + edge
    return value if value > 1e-15 else 1e-15


@njit(cache=True)
def _fill_per_sample(t):
    """`per_sample` of every class and layer range, once per table: the search reads it for every stage it costs, and
    computing it there (and an array per stage) took a third of a search with few micro-batches."""
    for k in range(t.K):
        for i in range(t.L):
            for j in range(i + 1, t.L + 1):
                t.ps[k, i, j] = per_sample(t, k, i, j)


@njit(cache=True)
def _fixed(t, i, j):
    return fixed_s(t.overhead, t.latency, t.L, i, j)


@njit(cache=True)
def fixed_s(overhead, latency, L, i, j):
    """A stage's seconds that do not depend on its samples: every layer's launches and every boundary's latency."""
    return 2 * (j - i) * overhead + 2 * (int(i > 0) + int(j < L)) * latency


@njit(cache=True)
def stage_allreduce(t, i, j, g):
    """Ring all-reduce of layers [i, j) across group g at its slowest class's link (costmodel.allreduce_s)."""
    c1, bps, c2 = ring_constants(t.link_mbps, t.link_bps, t.latency, g)
    return ring_s(t.params, t.factor, c1, bps, c2, i, j)


@njit(cache=True)
def ring_constants(link_mbps, link_bps, latency, g):
    """What `ring_s` needs of group g: 2 (n - 1) / n for its n devices, its slowest class's link in bytes/s and its
    2 (n - 1) latencies (a group of one: no all-reduce)."""
    n = 0
    slow = -1
    for k in range(g.shape[0]):
        if g[k]:
            n += g[k]
            if slow < 0 or link_mbps[k] < link_mbps[slow]:
                slow = k
    if n < 2:
        return 0.0, 1.0, 0.0
    return 2 * (n - 1) / n, link_bps[slow], 2 * (n - 1) * latency


@njit(cache=True)
def ring_s(params, factor, c1, bps, c2, i, j):
    """`stage_allreduce` of layers [i, j) from the group's `ring_constants` (the search reads them from the tables'
    `ring` per group code: looping over the classes at every call took a third of the bounding passes). Takes arrays,
    not the tables: numba passes a named tuple to a function field by field, and passing all of `Tables` cost ten
    times the arithmetic."""
    return c1 * ((params[j] - params[i]) * factor / 4) / bps + c2


@njit(cache=True)
def group_code(g, codes, size, ordered):
    """The number the search gives group g: its counts in the mixed radix of `codes` (exact search), or how many
    devices it has (ordered: a group is the next devices of the memory order, and a code of every count vector would
    overflow 64 bits past 63 distinct classes). Either way, the state after it is the state's number plus its code."""
    if ordered:
        return size
    code = 0
    for x in range(g.shape[0]):
        code += g[x] * codes[x]
    return code


@njit(cache=True)
def group_of(code, codes, full, rv, ordered, g):
    """Fill g with the group of `group_code` `code`, taken from a state with devices rv left."""
    left = code
    for x in range(g.shape[0]):
        if ordered:  # the next `code` devices in memory order: class by class
            g[x] = rv[x] if rv[x] < left else left
            left -= g[x]
        else:
            g[x] = (code // codes[x]) % (full[x] + 1)


@njit(cache=True)
def group_ring(ring, code, link_mbps, link_bps, latency, g, ordered):
    """Group g's `ring_constants`: from the table by its code (exact search), else worked out (the ordered search's
    groups are few per state, and a table of every count vector would not fit)."""
    if ordered:
        return ring_constants(link_mbps, link_bps, latency, g)
    return ring[code, 0], ring[code, 1], ring[code, 2]


@njit(cache=True)
def _fill_ring(link_mbps, link_bps, latency, full, strides, ring):
    """`ring_constants` of every group, by its code (counts per class in the mixed radix of `strides`)."""
    g = np.zeros(full.shape[0], np.int64)
    for code in range(ring.shape[0]):
        for k in range(full.shape[0]):
            g[k] = (code // strides[k]) % (full[k] + 1)
        ring[code, 0], ring[code, 1], ring[code, 2] = ring_constants(link_mbps, link_bps, latency, g)


@njit(cache=True)
def memory_free(t, i, j, g):
    """(time, all-reduce, most in-flight micro-batches every device still fits it) of group g's best split of m
    samples over layers [i, j) ignoring memory (`split_fit` plus the stage's fixed seconds and its all-reduce)."""
    best, most = split_fit(t.ps, t.static, t.saved, t.peak, t.memory, t.m, i, j, g)
    return _fixed(t, i, j) + best, stage_allreduce(t, i, j, g), most


@njit(cache=True)
def split_fit(ps, static, saved, peak, memory, m, i, j, g):
    """(seconds of samples, most in-flight micro-batches every device still fits) of group g's best split of m samples
    over layers [i, j) ignoring memory, from the tables' arrays (see `ring_s` for why).

    With identical devices per class the optimum has a closed form: every device's time is fixed + n * c_k, so the
    stage time is fixed + t for the least t on some class's grid q * c_k with sum_k count_k * floor(t / c_k) >= m,
    at least one sample per device. t lies between the fractional water level and that plus one sample of the
    slowest class; the same products as `allocation.allocate`'s, so the times agree exactly (the planner's tests
    check it). Memory only caps the in-flight micro-batches: while this split fits, it is the optimum.
    """
    K = g.shape[0]
    classes = 0
    only = -1
    for k in range(K):
        if g[k]:
            classes += 1
            only = k
    if classes == 1:
        best = -(-m // g[only]) * ps[only, i, j]
    else:
        inv = 0.0
        slowest = 0.0
        for k in range(K):
            if g[k]:
                inv += g[k] / ps[k, i, j]
                if ps[k, i, j] > slowest:
                    slowest = ps[k, i, j]
        lowest = m / inv
        if slowest > lowest:
            lowest = slowest
        best = math.inf
        for k in range(K):
            if not g[k]:
                continue
            q = max(1, math.ceil(lowest / ps[k, i, j] - 1e-9))
            while q * ps[k, i, j] < best:
                tt = q * ps[k, i, j]
                held = 0
                for k2 in range(K):
                    if g[k2]:
                        held += g[k2] * min(m, math.floor(tt / ps[k2, i, j] + 1e-9))
                if held >= m:
                    best = tt
                    break
                q += 1
    most = NO_CAP
    st = static[j] - static[i]
    sv = saved[j] - saved[i]
    pk = peak[i, j]
    for k in range(K):
        if not g[k]:
            continue
        n = min(m, math.floor(best / ps[k, i, j] + 1e-9))
        spare = memory[k] - st - n * pk
        if spare < 0:
            return best, 0
        if sv:
            most = min(most, spare // (n * sv))
    return best, most


@njit(cache=True)
def allocate_time(t, i, j, g, in_flight):
    """The stage time of `allocation.allocate` (memory-capped split) for group g, or -1 when it cannot fit."""
    return capped_time(t.ps, t.static, t.saved, t.peak, t.memory, t.m, _fixed(t, i, j), i, j, g, in_flight)


@njit(cache=True)
def capped_time(ps, static, saved, peak, memory, m, fixed, i, j, g, in_flight):
    """`allocate_time` from the tables' arrays (see `ring_s` for why), the stage's fixed seconds given."""
    K = g.shape[0]
    per = np.empty(K)
    cap = np.zeros(K, np.int64)
    size = 0
    for k in range(K):
        if g[k]:
            size += g[k]
            per[k] = ps[k, i, j]
            per_mem = in_flight * (saved[j] - saved[i]) + peak[i, j]
            free = memory[k] - (static[j] - static[i])
            cap[k] = 0 if free < 0 else (free // per_mem if per_mem > 0 else NO_CAP)
    if size == 0 or size > m:
        return -1.0
    room = 0
    for k in range(K):
        if g[k]:
            if cap[k] < 1:
                return -1.0
            room += min(cap[k], m) * g[k]
    if room < m:
        return -1.0
    return _water_fill(np.full(K, fixed), per, cap, g, m, np.zeros(K, np.int64), np.zeros(K, np.int64))


Tables = namedtuple(
    "Tables",
    "L M m K prefix divisor out rate off gbits bits codec codec_div vbytes overhead latency params factor link_mbps "
    "link_bps static saved peak memory Wp speed total_speed ps ring",
)


def tables(search) -> Tables:
    """The arrays `front_search` reads for one `asteroid._Search` (one micro-batch count)."""
    w, cluster, classes = search.w, search.cluster, search.classes
    L, K = w.num_layers, len(classes)
    prefix = np.empty((K, L + 1))
    divisor = np.ones(K)
    codec_div = np.zeros(K)
    level = search.levels[0]
    for k, devs in enumerate(classes):
        table = w._tables.get(devs[0].name)
        if table is None:  # work / its FLOP rate
            prefix[k] = w._work
            divisor[k] = codec_div[k] = devs[0].flops_per_s
        else:  # its own per-layer seconds
            prefix[k] = table[2]
            total = table[2][-1]
            codec_div[k] = w._work[-1] / total if total > 0 else 0.0
    peak_bytes = np.asarray(w.peak_bytes, dtype=np.int64)
    peak = np.zeros((L + 1, L + 1), np.int64)
    for i in range(L):
        peak[i, i + 1 :] = np.maximum.accumulate(peak_bytes[i:])
    mbps = np.array([cluster.link_mbps_of(c[0]) for c in classes], dtype=np.float64)
    out = w.output_bytes
    t = Tables(
        L=L,
        M=search.M,
        m=search.m,
        K=K,
        prefix=prefix,
        divisor=divisor,
        out=np.asarray(out, dtype=np.int64),
        rate=np.array([cluster.link_mbps_of(c[0]) * 1e6 / 8 for c in classes]),
        off=level >= OFF,
        gbits=gradient_bits(level),
        bits=level,
        codec=float(w._codec.get(level, DEFAULT_CODEC_WORK)),
        codec_div=codec_div,
        vbytes=float(w.value_bytes),
        overhead=float(LAYER_OVERHEAD_S),
        latency=float(cluster.latency_s),
        params=np.asarray(w._params, dtype=np.int64),
        factor=ALLREDUCE[search.allreduce],
        link_mbps=mbps,
        link_bps=np.array([cluster.bytes_per_s_of(c[0].name) for c in classes]),
        static=np.asarray(w._static, dtype=np.int64),
        saved=np.asarray(w._saved, dtype=np.int64),
        peak=peak,
        memory=np.array([c[0].memory_bytes for c in classes], dtype=np.int64),
        Wp=np.asarray(w.work_prefix, dtype=np.float64),
        speed=np.asarray(search.speed, dtype=np.float64),
        total_speed=float(sum(len(c) * s for c, s in zip(classes, search.speed))),
        ps=search.shared.get("per_sample"),
        ring=search.shared.get(("ring", search.exact)),
    )
    if t.ps is None:  # the same for every micro-batch count of the problem: filled once
        t = t._replace(ps=np.zeros((K, L + 1, L + 1)))
        _fill_per_sample(t)
        search.shared["per_sample"] = t.ps
    if t.ring is None:  # also: every group code's all-reduce constants, for the exact search (`group_ring`)
        full = np.array([len(c) for c in classes], dtype=np.int64)
        t = t._replace(ring=np.zeros((int(np.prod(full + 1)) if search.exact else 0, 3)))
        if search.exact:
            _fill_ring(t.link_mbps, t.link_bps, t.latency, full, search.states()[1], t.ring)
        search.shared[("ring", search.exact)] = t.ring
    return t
