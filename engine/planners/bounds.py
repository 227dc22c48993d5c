"""Bounds for the planner's compiled search (engine.planners.kernel): what the stages before and after each state take.

Two passes over the search's own moves, without fronts (`bounds`), and the windows of end layers a stage may take;
`kernel.front_search` calls them before it fills the fronts, and shares the move order (`next_move`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.planners.stagecosts import fixed_s, group_code, group_of, group_ring, ring_s


@njit(cache=True)
def next_move(g, rv, ordered):
    """Advance g (all zeros before the first move) to the next group a state of devices left rv may give its stage:
    every g <= rv (exact) or the next devices in memory order (ordered); False when there is none."""
    K = g.shape[0]
    if ordered:
        for x in range(K):
            if g[x] < rv[x]:
                g[x] += 1
                return True
        return False
    x = K - 1
    while x >= 0 and g[x] == rv[x]:
        g[x] = 0
        x -= 1
    if x < 0:
        return False
    g[x] += 1
    return True


@njit(cache=True)
def work_window(M, m, sg, sr, R, room, tail):
    """The work x of the stage's layers, out of the R left, for which the stage (at least m x / sg seconds) and the
    layers after it (at least (R - x) m / sr) can fit `room` as the search requires of every entry: M u + rest <=
    room, u + M rest <= room and u + rest + tail <= room. Each is linear in x; the window is their intersection
    (lo > hi: none), widened by a relative 1e-9 so that float rounding never rules out what the exact test keeps."""
    lo, hi = 0.0, R
    for case in range(3):
        if case == 0:
            a, c = M * m / sg - m / sr, room - R * m / sr
        elif case == 1:
            a, c = m / sg - M * m / sr, room - M * R * m / sr
        else:
            a, c = m / sg - m / sr, room - tail - R * m / sr
        if a > 0:
            hi = min(hi, c / a)
        elif a < 0:
            lo = max(lo, c / a)
        elif c < 0:
            return 1.0, 0.0
    slack = 1e-9 * R
    return lo - slack, hi + slack


@njit(cache=True)
def split_floor(ps, m, i, j, g, fixed):
    """A stage time no split of group g's m samples over layers [i, j) beats: the samples split fractionally by the
    per-sample times ps, no memory cap, plus the stage's fixed seconds (a hair lower, so that float rounding never puts
    it above `split_fit`'s). Takes arrays, not the tables: see `stagecosts.ring_s`."""
    inv = 0.0
    for x in range(g.shape[0]):
        if g[x]:
            inv += g[x] / ps[x, i, j]
    return (m / inv) * (1 - 1e-9) + fixed


@njit(cache=True)
def end_window(Wp, Wi, Wl, i, top, m, M, sg, sr, limit, room, tail, lroom, pm, overhead, params, factor, c1, bps,
               c2):  # fmt: skip
    """(lo, hi): the end layers j in [i + 1, top] (lo > hi: none) a stage from layer i on group g (of speed sg, the
    devices left after it of speed sr) may take. Its work and the work after it each fit the cap `limit` per
    micro-batch and `work_window`'s window (of `room`, `tail`); then the last j for which the stage can still fit
    `lroom` as u + all-reduce + (M - 1) max(pm, u), u counted from below by its work over sg and its layers'
    launches, is found by bisection, as all three grow with j. The work window alone leaves launches and all-reduce
    out: with few micro-batches most of the ends it keeps (94 % at 128 boards x 200 layers, 4 micro-batches) fail."""
    hi = min(np.searchsorted(Wp, Wi + limit * sg / m, side="right") - 1, top)
    lo = max(np.searchsorted(Wp, Wl - limit * sr / m, side="left"), i + 1)
    x_lo, x_hi = work_window(M, m, sg, sr, Wl - Wi, room, tail)
    if x_lo > x_hi:
        return lo, lo - 1
    hi = min(hi, np.searchsorted(Wp, Wi + x_hi, side="right") - 1)
    lo = max(lo, np.searchsorted(Wp, Wi + x_lo, side="left"))
    a = lo
    while a <= hi:
        mid = (a + hi) // 2
        u = ((Wp[mid] - Wi) * m / sg + 2 * (mid - i) * overhead) * (1 - 1e-9)  # a hair lower: float rounding
        ar = ring_s(params, factor, c1, bps, c2, i, mid)
        if u + ar + (M - 1) * (u if u > pm else pm) <= lroom:
            a = mid + 1
        else:
            hi = mid - 1
    return lo, hi


@njit(cache=True)
def bounds(t, cap_bound, limit, cuts, states, codes, ordered):
    """Lower bounds, over the plans with iteration time <= cap_bound, on what the stages before and after each state
    take (inf: no such plan passes through it): Sp and Pm, the least sum and least slowest of the stage times before
    it; Ss and Us, those of the stages from it on.

    Two passes over the same moves as `front_search`, without fronts, each stage timed from below: its samples split
    fractionally by the per-sample times (no memory cap; `split_fit`'s exact split costs about 30 times as much and
    bounds barely better). The forward pass reaches the states some plan's first stages can; the backward pass, over
    those, keeps the ones the rest of some plan can then finish. The search skips every other state and starts each
    from these bounds instead of from its work over its devices' speed: at 64 boards x 200 layers the round that finds
    the optimum took 0.4 s instead of 6-8 s, and a micro-batch count without a plan within the bound is ruled out
    here, in milliseconds (Ss[0, 0] = inf).
    """
    L, R = t.L, states.shape[0]
    Sp = np.full((L + 1, R), np.inf)
    Pm = np.full((L + 1, R), np.inf)
    Ss = np.full((L + 1, R), np.inf)
    Us = np.full((L + 1, R), np.inf)
    Sp[0, 0] = 0.0
    Pm[0, 0] = 0.0
    any_cut = np.zeros(L + 1, np.bool_)
    for j in range(L + 1):
        for k in range(cuts.shape[0]):
            any_cut[j] = any_cut[j] or cuts[k, j]
    moves = _forward(t, cap_bound, limit, any_cut, states, codes, ordered, Sp, Pm)
    _backward(t, cap_bound, any_cut, states, codes, ordered, Sp, Pm, Ss, Us, moves)
    return Sp, Pm, Ss, Us


@njit(cache=True)
def grow(a, need):
    """a, or a copy of it with room for `need` (at least twice the room)."""
    if need <= a.shape[0]:
        return a
    b = np.empty(max(need, 2 * a.shape[0]), a.dtype)
    b[: a.shape[0]] = a
    return b


@njit(cache=True)
def _within(top, M, sp, pm, u, rest_s, rest_u, params, factor, c1, bps, c2, i, j):
    """Whether a stage of at least u seconds on layers [i, j), after stages of sum sp and slowest pm and before stages
    of sum rest_s and slowest rest_u, leaves room for its all-reduce (computed only when the rest fits) within top."""
    most = u if u > pm else pm
    most = most if most > rest_u else rest_u
    if sp + u + rest_s + (M - 1) * most > top:
        return False
    ar = ring_s(params, factor, c1, bps, c2, i, j)
    return not sp + u + rest_s + ar + (M - 1) * most > top


@njit(cache=True)
def _forward(t, cap_bound, limit, any_cut, states, codes, ordered, Sp, Pm):  # noqa: C901
    """The forward pass of `bounds`: Sp and Pm of every state a move leads to, the layers after each move bounded by
    their work over the speed of the devices left. Returns the moves it found room for, for `_backward`, which sees
    the same states with the same Sp and Pm and so the same end windows: per (layer, state) the first and how many,
    and per move its group code, its first and last end layer before the model's end and whether it may end there
    (the backward pass took as long as this one while it enumerated and windowed every group again)."""
    L, M, m, K = t.L, t.M, t.m, t.K
    Wp, speed, ps, overhead, latency = t.Wp, t.speed, t.ps, t.overhead, t.latency
    params, factor, ring, link_mbps, link_bps = t.params, t.factor, t.ring, t.link_mbps, t.link_bps
    R = states.shape[0]
    g = np.zeros(K, np.int64)
    Wl = Wp[L]
    top = cap_bound * (1 + 1e-9)
    first = np.zeros((L + 1, R), np.int64)
    count = np.zeros((L + 1, R), np.int64)
    n = 0
    move_g, move_lo, move_hi = np.empty(1024, np.int64), np.empty(1024, np.int64), np.empty(1024, np.int64)
    move_last = np.empty(1024, np.bool_)
    for i in range(L):
        Wi = Wp[i]
        for r in range(R):
            sp, pm = Sp[i, r], Pm[i, r]
            if sp == np.inf:
                continue
            first[i, r] = n
            rv = states[r]
            for x in range(K):
                g[x] = 0
            while next_move(g, rv, ordered):
                size = 0
                sg = 0.0
                sr = 0.0
                n_rest = 0
                for x in range(K):
                    size += g[x]
                    sg += g[x] * speed[x]
                    sr += (rv[x] - g[x]) * speed[x]
                    n_rest += rv[x] - g[x]
                if size > m:
                    if ordered:
                        break
                    continue
                gcode = group_code(g, codes, size, ordered)
                child = r + gcode
                c1, bps, c2 = group_ring(ring, gcode, link_mbps, link_bps, latency, g, ordered)
                lo, hi = L + 1, L - 1
                if n_rest >= 1:
                    lo, hi = end_window(
                        Wp, Wi, Wl, i, L - 1, m, M, sg, sr, limit, cap_bound - sp, (M - 1) * pm, top - sp, pm,
                        overhead, params, factor, c1, bps, c2,
                    )  # fmt: skip
                last = (Wl - Wi) * m <= limit * sg
                if hi < lo and not last:
                    continue
                if n == move_g.shape[0]:
                    move_g, move_lo, move_hi = grow(move_g, n + 1), grow(move_lo, n + 1), grow(move_hi, n + 1)
                    move_last = grow(move_last, n + 1)
                move_g[n], move_lo[n], move_hi[n], move_last[n] = gcode, lo, hi, last
                n += 1
                middle = hi - lo + 1 if hi >= lo else 0
                for step in range(middle):  # the model's end needs no bound here: no state is after it
                    j = lo + step
                    if not any_cut[j]:
                        continue
                    rest_s = (Wl - Wp[j]) * m / sr
                    u = split_floor(ps, m, i, j, g, fixed_s(overhead, latency, L, i, j))
                    if not _within(top, M, sp, pm, u, rest_s, rest_s, params, factor, c1, bps, c2, i, j):
                        continue
                    if sp + u < Sp[j, child]:
                        Sp[j, child] = sp + u
                    u_max = u if u > pm else pm
                    if u_max < Pm[j, child]:
                        Pm[j, child] = u_max
            count[i, r] = n - first[i, r]
    return first, count, move_g, move_lo, move_hi, move_last


@njit(cache=True)
def _backward(t, cap_bound, any_cut, states, codes, ordered, Sp, Pm, Ss, Us, moves):  # noqa: C901
    """The backward pass of `bounds`: Ss and Us of every state with Sp, over the moves `_forward` found room for, the
    layers after each move bounded by the Ss and Us of the state it leads to."""
    L, M, m, K = t.L, t.M, t.m, t.K
    ps, overhead, latency, params, factor, ring = t.ps, t.overhead, t.latency, t.params, t.factor, t.ring
    link_mbps, link_bps = t.link_mbps, t.link_bps
    first, count, move_g, move_lo, move_hi, move_last = moves
    full = states[0]
    g = np.zeros(K, np.int64)
    top = cap_bound * (1 + 1e-9)
    for i in range(L - 1, -1, -1):
        for r in range(states.shape[0]):
            sp, pm = Sp[i, r], Pm[i, r]
            if sp == np.inf:
                continue
            for e in range(first[i, r], first[i, r] + count[i, r]):
                gcode, lo, hi = move_g[e], move_lo[e], move_hi[e]
                group_of(gcode, codes, full, states[r], ordered, g)
                child = r + gcode
                c1, bps, c2 = group_ring(ring, gcode, link_mbps, link_bps, latency, g, ordered)
                middle = hi - lo + 1 if hi >= lo else 0
                for step in range(middle + (1 if move_last[e] else 0)):
                    j = L if step == middle else lo + step
                    if j < L and not any_cut[j]:
                        continue
                    rest_s, rest_u = 0.0, 0.0
                    if j < L:
                        rest_s, rest_u = Ss[j, child], Us[j, child]
                        if rest_s == np.inf:
                            continue
                    u = split_floor(ps, m, i, j, g, fixed_s(overhead, latency, L, i, j))
                    if not _within(top, M, sp, pm, u, rest_s, rest_u, params, factor, c1, bps, c2, i, j):
                        continue
                    after = u if u > rest_u else rest_u
                    if u + rest_s < Ss[i, r]:
                        Ss[i, r] = u + rest_s
                    if after < Us[i, r]:
                        Us[i, r] = after
