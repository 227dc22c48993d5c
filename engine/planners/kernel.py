"""The Asteroid planner's dynamic programme, compiled (numba): fronts per (first layer, devices left, stages to go).

`engine.planners.asteroid` documents the search; this module is its inner loop, the same arithmetic in the same
order, so the plans are those of the search as written there. Python prepares `stagecosts.Tables` (prefix sums
and per-class constants, once per micro-batch count) and `front_search` fills every state's front bottom-up (a state
only needs states of later first layers), skipping at entry every state the bound rules out; the caller follows
the links of the entries it returns. The first call compiles (about 10 s, cached on disk after that; `make venv`
compiles it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.planners.bounds import bounds, end_window, grow, next_move, split_floor
from engine.planners.stagecosts import capped_time, fixed_s, group_code, group_ring, ring_s, split_fit


@njit(cache=True)
def _entries(n):
    """Room for n front entries: bottleneck, sum and all-reduce seconds; end layer, group code and next entry."""
    return np.empty(n), np.empty(n), np.empty(n), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)


@njit(cache=True)
def _grow_entries(U, S, A, j, g, n, need):
    """The six arrays of `_entries`, each with room for `need`."""
    return grow(U, need), grow(S, need), grow(A, need), grow(j, need), grow(g, need), grow(n, need)


@njit(cache=True)
def _extend(pU, pS, pA, cs, ce, f_c, lim, u, ar, floor, f, M, j, gcode, eU, eS, eA, ej, eg, en, n_e):
    """Append to the candidates (room is there for ce - cs more) the child front's entries [cs, ce) that, after a
    stage of time u and all-reduce ar, still fit `lim`; return the new count.

    The hot loops live in functions of their own, with arrays that are never reassigned there: numba counts
    references to an array that a loop may reassign at every use, and those atomic counts took 40 % of the search.
    """
    u0 = u if u > f else f
    # Every candidate of this stage has U' = max(U, f) >= u0 and A >= ar, so one with U' = u0 and A = ar beats every
    # later one of no smaller S: they are never kept, so they are not appended.
    least = np.inf
    for e in range(cs, ce):
        # fronts are sorted by (M - 1) max(U, floor) + S + A, which no way of extending an entry lowers (the floor
        # is at most max(u, up) here)
        if (M - 1) * (pU[e] if pU[e] > f_c else f_c) + pS[e] + pA[e] > lim:
            break
        U = u if u > pU[e] else pU[e]
        A = ar if ar > pA[e] else pA[e]
        if (M - 1) * (U if U > floor else floor) + pS[e] + A <= lim:
            S = u + pS[e]
            if S >= least:
                continue
            if (U if U > f else f) == u0 and A == ar:
                least = S
            eU[n_e], eS[n_e], eA[n_e], ej[n_e], eg[n_e], en[n_e] = U, S, A, j, gcode, e
            n_e += 1
    return n_e


@njit(cache=True)
def _keep_front(eU, eS, eA, ej, eg, en, n_e, f, M, pU, pS, pA, pj, pg, pn, used, beam):
    """Append the state's front to the fronts at `used` (room is there for all n_e candidates): the candidates no
    other beats for every way of finishing the plan; return how many.

    Finishing adds stages of time x >= f and all-reduce y to both: with U' = max(U, f), e1 is never worse than e2 iff
    S1 + (M - 1)(U1' - U2')+ + (A1 - A2)+ <= S2. A beating entry has the smaller key (M - 1) U' + S + A, so in key
    order only kept ones can beat. Which one beats does not matter, so the likeliest are tried first.
    """
    key = np.empty(n_e)
    for e in range(n_e):
        key[e] = (M - 1) * (eU[e] if eU[e] > f else f) + eS[e] + eA[e]
    order = np.argsort(key, kind="mergesort")
    kept = 0
    last = -1  # the entry that beat the candidate before: it often beats the next one too
    for o in range(n_e):
        if kept == beam:
            break
        e = order[o]
        U, S, A = eU[e], eS[e], eA[e]
        beaten = False
        for step in range(kept + 1):  # that entry first, then the kept ones newest first
            if step == 0:
                if last < 0:
                    continue
                q = last
            else:
                q = used + kept - step
                if q == last:
                    continue
            du, da = (pU[q] if pU[q] > f else f) - (U if U > f else f), pA[q] - A
            if pS[q] + (M - 1) * (du if du > 0 else 0.0) + (da if da > 0 else 0.0) <= S:
                beaten = True
                last = q
                break
        if not beaten:
            q = used + kept
            pU[q], pS[q], pA[q], pj[q], pg[q], pn[q] = U, S, A, ej[e], eg[e], en[e]
            kept += 1
    return kept


@njit(cache=True, nogil=True)
def front_search(t, cap_bound, limit, ks, k_top, cuts, states, codes, ordered, keep, beam):  # noqa: C901
    """Fill the fronts of every state, bottom-up, and return the `keep` best plans at the top.

    `states[r]`: the device counts of state r; `codes`: mixed-radix strides turning counts into a state index
    (exact search) or, when `ordered`, states are "the first r devices in memory order used". `ks`: the stage
    counts wanted at the top (0: any, the relaxed memory); `cuts[k, j]`: whether a stage with k stages to go
    (itself included) may end after layer j. Returns the top plans (their times, stage counts and entries,
    fastest first) and every entry's end layer, group code and next entry, for the caller to follow.
    """
    L, M, m, K = t.L, t.M, t.m, t.K
    Wp, speed, total_speed, ps, overhead, latency = t.Wp, t.speed, t.total_speed, t.ps, t.overhead, t.latency
    params, factor, ring, link_mbps, link_bps = t.params, t.factor, t.ring, t.link_mbps, t.link_bps
    static, saved, peak, memory = t.static, t.saved, t.peak, t.memory
    R = states.shape[0]
    relaxed = ks[0] == 0
    nk = 1 if relaxed else k_top + 1
    start = np.full((nk, L + 1, R), -1, np.int64)
    length = np.zeros((nk, L + 1, R), np.int64)
    pU, pS, pA, pj, pg, pn = _entries(1024)  # every state's front, one after another
    used = 0
    eU, eS, eA, ej, eg, en = _entries(256)  # the candidates of the state being filled
    g = np.zeros(K, np.int64)
    rest = np.zeros(K, np.int64)
    Wl = Wp[L]
    # Every plan's slowest stage takes at least the whole work over the whole cluster's speed, and at least the
    # work before a state over the speed of the devices left for it: below that floor, a front entry's own
    # slowest stage cannot decide the plan's, so the fronts compare entries' slowest stages from the floor up.
    # Only when one plan is wanted: the ranking asks the fronts for more of the trade-offs (`keep`).
    lb_all = Wl * m / total_speed if keep == 1 else 0.0
    Sp, Pm, Ss, Us = bounds(t, cap_bound, limit, cuts, states, codes, ordered)
    if Ss[0, 0] == np.inf:  # no plan within the bound
        empty = np.empty(0, np.int64)
        return np.empty(0), empty, empty, empty, empty, empty
    if keep == 1 and Us[0, 0] > lb_all:  # every plan's slowest stage
        lb_all = Us[0, 0]
    for i in range(L - 1, -1, -1):
        Wi = Wp[i]
        for r in range(R):
            rv = states[r]
            n_r = 0
            s_r = 0.0
            for k in range(K):
                n_r += rv[k]
                s_r += rv[k] * speed[k]
            if n_r == 0 or (i > 0 and r == 0):  # no device left, or layers before it on no device
                continue
            # the stages before: at least their work over the speed of the devices they had, and at least what the
            # forward pass found (its sum a hair lower, so that no float rounding ever rules out a plan at the bound)
            up = Wi * m / (total_speed - s_r) if i else 0.0
            sp = Sp[i, r] * (1 - 1e-12)
            sp = sp if sp > up else up
            pm = Pm[i, r] if Pm[i, r] > up else up
            us = (Wl - Wi) * m / s_r  # and the stages from here on (inf: no plan within the bound gets through)
            ss = Ss[i, r] * (1 - 1e-12)
            ss = ss if ss > us else us
            us = Us[i, r] if Us[i, r] > us else us
            if (M - 1) * (pm if pm > us else us) + sp + ss > cap_bound:
                for kk in range(nk):
                    start[kk, i, r] = used
                continue
            room = cap_bound - sp
            f = pm if pm > lb_all and keep == 1 else lb_all
            tail = (M - 1) * pm
            for kk in range(nk):
                k = 0 if relaxed else kk
                if not relaxed and (k == 0 or k > L - i or k > n_r):
                    start[kk, i, r] = used
                    continue
                row = 0 if relaxed else k + 1  # the stage before ends at i: may it?
                if i > 0 and (row >= nk or not cuts[row, i]):
                    start[kk, i, r] = used
                    continue
                in_flight = (k if k < M else M) if k else 1
                after = k - 1 if k - 1 > 1 else 1
                n_e = 0
                # moves: every group g <= r (exact) or the next devices in memory order (ordered)
                for x in range(K):
                    g[x] = 0
                while next_move(g, rv, ordered):
                    size = 0
                    for x in range(K):
                        size += g[x]
                    if size > m:
                        if ordered:
                            break
                        continue
                    sg = 0.0
                    sr = 0.0
                    n_rest = 0
                    for x in range(K):
                        rest[x] = rv[x] - g[x]
                        sg += g[x] * speed[x]
                        sr += rest[x] * speed[x]
                        n_rest += rest[x]
                    gcode = group_code(g, codes, size, ordered)
                    child = r + gcode  # states are numbered by the devices used
                    c1, bps, c2 = group_ring(ring, gcode, link_mbps, link_bps, latency, g, ordered)
                    lo, hi = L + 1, L - 1
                    if k != 1 and n_rest >= after:
                        lo, hi = end_window(
                            Wp, Wi, Wl, i, L - after, m, M, sg, sr, limit, room, tail, room * (1 + 1e-9), pm,
                            overhead, params, factor, c1, bps, c2,
                        )  # fmt: skip
                    last = k <= 1 and (Wl - Wi) * m <= limit * sg
                    middle = hi - lo + 1 if hi >= lo else 0
                    for step in range(middle + (1 if last else 0)):
                        if step == middle:
                            j = L
                        else:
                            j = lo + step
                            if not cuts[k, j]:
                                continue
                        rest_s = (Wl - Wp[j]) * m / sr if j < L else 0.0
                        most = tail if tail > (M - 1) * rest_s else (M - 1) * rest_s
                        u_max = min((room - rest_s) / M, room - rest_s - most)
                        fixed = fixed_s(overhead, latency, L, i, j)
                        u_lb = split_floor(ps, m, i, j, g, fixed)
                        if u_lb > u_max:
                            continue
                        # the all-reduce is the stage's alone: with it, the bound above may already be passed
                        ar = ring_s(params, factor, c1, bps, c2, i, j)
                        if u_lb + ar + rest_s + (M - 1) * max(u_lb, pm, rest_s) > room * (1 + 1e-9):
                            continue
                        best, fits = split_fit(ps, static, saved, peak, memory, m, i, j, g)
                        u = fixed + best
                        if in_flight > fits:
                            u = capped_time(ps, static, saved, peak, memory, m, fixed, i, j, g, in_flight)
                            if u < 0:
                                continue
                        if u > u_max:
                            continue
                        if j == L:
                            if (M - 1) * (u if u > pm else pm) + u + ar <= room:
                                if n_e + 1 > eU.shape[0]:
                                    eU, eS, eA, ej, eg, en = _grow_entries(eU, eS, eA, ej, eg, en, n_e + 1)
                                eU[n_e], eS[n_e], eA[n_e], ej[n_e], eg[n_e], en[n_e] = u, u, ar, j, gcode, -1
                                n_e += 1
                            continue
                        lim = room - u
                        floor = u if u > pm else pm
                        ck = 0 if relaxed else k - 1
                        cs = start[ck, j, child]
                        f_c = Wp[j] * m / (total_speed - sr)  # the child state's floor, as it computed it
                        f_c = f_c if f_c > Pm[j, child] else Pm[j, child]
                        f_c = f_c if f_c > lb_all and keep == 1 else lb_all
                        ce = cs + length[ck, j, child]
                        if n_e + ce - cs > eU.shape[0]:
                            eU, eS, eA, ej, eg, en = _grow_entries(eU, eS, eA, ej, eg, en, n_e + ce - cs)
                        n_e = _extend(
                            pU, pS, pA, cs, ce, f_c, lim, u, ar, floor, f, M, j, gcode, eU, eS, eA, ej, eg, en, n_e
                        )
                start[kk, i, r] = used
                if n_e:
                    pU, pS, pA, pj, pg, pn = _grow_entries(pU, pS, pA, pj, pg, pn, used + n_e)
                    kept = _keep_front(eU, eS, eA, ej, eg, en, n_e, f, M, pU, pS, pA, pj, pg, pn, used, beam)
                    length[kk, i, r] = kept
                    used += kept
    # the top: every wanted stage count's front at (layer 0, every device), fastest first
    full = 0
    n_top = 0
    for kk in range(ks.shape[0]):
        k = ks[kk]
        n_top += length[0 if relaxed else k, 0, full]
    times = np.empty(n_top)
    entries = np.empty(n_top, np.int64)
    stages = np.empty(n_top, np.int64)
    n = 0
    for kk in range(ks.shape[0]):
        k = ks[kk]
        row = 0 if relaxed else k
        s0 = start[row, 0, full]
        for e in range(s0, s0 + length[row, 0, full]):
            times[n] = pS[e] + (M - 1) * pU[e] + pA[e]
            entries[n] = e
            stages[n] = k
            n += 1
    order = np.argsort(times, kind="mergesort")[:keep]
    return times[order], stages[order], entries[order], pj[:used].copy(), pg[:used].copy(), pn[:used].copy()


def warm() -> None:
    """Compile the search and the simulator's loops (engine.simkernel), or load them from numba's cache, by planning
    a two-layer model on two boards (ranked: it simulates under every schedule)."""
    from engine.costmodel import Workload
    from engine.devices import Cluster, Device
    from engine.planners import Problem, asteroid

    w = Workload("warm-up", (1e9, 1e9), (2e9, 2e9), (1000, 1000), (1000, 1000), (1000, 1000), (1000, 1000), (0, 0))
    cluster = Cluster((Device.of_kind("a", "nano"), Device.of_kind("b", "nx")), name="warm-up")
    asteroid.plan(Problem(w, cluster, 4))
