"""The simulator's event loop and the zero-bubble lists' replay, compiled (numba).

`engine.simulator` and `engine.schedule` document what they compute; these are their inner loops, the same
arithmetic in the same order on arrays, so the times are those of the loops as written there to the last bit.
A planner simulates hundreds of candidate plans per re-plan; in Python these two loops were most of its time.
Kinds are coded F = 0, B = 1, W = 2. The first call compiles (cached on disk after that; `make venv` does it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

F, B, W = 0, 1, 2


@njit(cache=True)
def _order(M, warm):
    """1F1B's order of forwards and backwards after `warm` warm-up forwards: kinds and micro-batches."""
    kinds, mbs = np.empty(2 * M, np.int64), np.empty(2 * M, np.int64)
    n = 0
    for m in range(warm):
        kinds[n], mbs[n] = F, m
        n += 1
    f = warm
    for b in range(M):
        if f < M:
            kinds[n], mbs[n] = F, f
            n += 1
            f += 1
        kinds[n], mbs[n] = B, b
        n += 1
    return kinds, mbs


@njit(cache=True)
def one_f_one_b(S, M):
    """`engine.schedule.one_f_one_b` as kinds and micro-batches, S x 2M: stage s warms up with min(S - s - 1, M)
    forwards."""
    kinds, mbs = np.empty((S, 2 * M), np.int64), np.empty((S, 2 * M), np.int64)
    for s in range(S):
        kinds[s], mbs[s] = _order(M, min(S - s - 1, M))
    return kinds, mbs


@njit(cache=True)
def replay(times, M, warm, cap):  # noqa: C901
    """`engine.schedule._replay` on `times` (S x 5: forward, backward, weight, send forward, send backward):
    (end, kinds, micro-batches), the last two S x 3M, or end = -1 where no stage can move. Stages move in order
    of (clock, stage), as its heap pops them (each stage is waiting at most once)."""
    S = times.shape[0]
    n_order = 2 * M
    okind, omb = np.empty((S, n_order), np.int64), np.empty((S, n_order), np.int64)
    for s in range(S):
        okind[s], omb[s] = _order(M, min(warm[s], M))
    clock = np.zeros(S)
    pos = np.zeros(S, np.int64)
    done = np.zeros((S, 3), np.int64)
    arrive = np.zeros((2, S, M))  # when each micro-batch's input (0) and output gradient (1) arrives ...
    known = np.zeros((2, S, M), np.bool_)  # ... once it is known
    known[0, 0, :] = True
    kinds, mbs = np.empty((S, 3 * M), np.int64), np.empty((S, 3 * M), np.int64)
    count = np.zeros(S, np.int64)
    queued = np.ones(S, np.bool_)
    at_clock = np.zeros(S)  # each queued stage's heap key
    while True:
        s = -1
        for k in range(S):  # the heap's pop: the smallest (clock, stage)
            if queued[k] and (s < 0 or at_clock[k] < at_clock[s]):
                s = k
        if s < 0:
            break
        t = at_clock[s]
        queued[s] = False
        has_next = pos[s] < n_order
        at, has_at, capped = 0.0, False, False
        nk = nm = 0
        if has_next:
            nk, nm = okind[s, pos[s]], omb[s, pos[s]]
            has_at = known[nk, s, nm]
            at = arrive[nk, s, nm]
            capped = nk == F and done[s, F] - done[s, W] >= cap[s]
        if has_next and not capped and has_at and at <= t:
            kind = nk
            length = times[s, 0] if nk == F else times[s, 1]
            pos[s] += 1
        elif done[s, W] < done[s, B] and (capped or not has_at or t + times[s, 2] <= at):
            kind, length = W, times[s, 2]
        else:
            if has_at:  # wait for what is on its way; else for a message not yet sent
                clock[s] = max(t, at)
                at_clock[s] = clock[s]
                queued[s] = True
            continue
        mb = done[s, kind]
        kinds[s, count[s]], mbs[s, count[s]] = kind, mb
        count[s] += 1
        done[s, kind] += 1
        end = t + length
        clock[s] = end
        if count[s] < 3 * M:
            at_clock[s] = end
            queued[s] = True
        woken = -1
        if kind == F:
            if s + 1 < S:
                arrive[0, s + 1, mb] = end + times[s, 3]
                known[0, s + 1, mb] = True
                woken = s + 1
            else:
                arrive[1, s, mb] = end  # the last stage's loss gradient is its own
                known[1, s, mb] = True
        elif kind == B and s > 0:
            arrive[1, s - 1, mb] = end + times[s, 4]
            known[1, s - 1, mb] = True
            woken = s - 1
        if woken >= 0 and not queued[woken] and count[woken] < 3 * M:
            at_clock[woken] = clock[woken]
            queued[woken] = True
    for s in range(S):
        if count[s] < 3 * M:
            return -1.0, kinds, mbs
    return clock.max(), kinds, mbs


@njit(cache=True)
def run(stage, dur, acts_kind, acts_mb, M, expected, send_at, send_peer, send_s, last_kind):  # noqa: C901
    """`engine.simulator.simulate`'s event loop. Device d (in plan order) of stage `stage[d]` runs its stage's
    actions (`acts_kind`/`acts_mb`; M micro-batches) taking `dur[d, kind]`; a forward or backward waits for
    `expected[d, kind]` arrivals, and its sends are `send_peer`/`send_s` [send_at[d, kind], send_at[d, kind + 1]).
    Returns every device's clock, link and last gradient step (start, end) (`last_kind`), the busy seconds, and
    the log: each step run (device, kind, micro-batch; start, end) in order, and each send's start. A deadlock
    leaves the log short."""
    D, S, n = stage.shape[0], acts_kind.shape[0], acts_kind.shape[1]
    count = np.zeros((D, 3, M), np.int64)
    latest = np.zeros((D, 3, M))  # the latest arrival so far (max of none is 0.0)
    clock, link = np.zeros(D), np.zeros(D)
    position = np.zeros(D, np.int64)
    own_forward_end = np.zeros((D, M))
    last_grad = np.zeros((D, 2))
    remaining = D * n
    log_i = np.empty((remaining, 3), np.int64)
    log_t = np.empty((remaining, 2))
    sends = np.empty(send_peer.shape[0] * M)  # each send once per micro-batch
    n_log = n_send = 0
    busy = 0.0
    while remaining:
        progressed = False
        for d in range(D):
            s = stage[d]
            while position[d] < n:
                kind, mb = acts_kind[s, position[d]], acts_mb[s, position[d]]
                if kind != W and count[d, kind, mb] < expected[d, kind]:
                    break
                ready = latest[d, kind, mb]
                if kind == B and s == S - 1:
                    ready = own_forward_end[d, mb]
                start = max(clock[d], ready)
                end = start + dur[d, kind]
                log_i[n_log, 0], log_i[n_log, 1], log_i[n_log, 2] = d, kind, mb
                log_t[n_log, 0], log_t[n_log, 1] = start, end
                n_log += 1
                if kind == F:
                    own_forward_end[d, mb] = end
                elif kind == last_kind:
                    last_grad[d, 0], last_grad[d, 1] = start, end
                t = max(end, link[d])
                if kind != W:
                    for x in range(send_at[d, kind], send_at[d, kind + 1]):
                        sends[n_send] = t
                        n_send += 1
                        t += send_s[x]
                        p = send_peer[x]
                        latest[p, kind, mb] = max(latest[p, kind, mb], t)  # arrivals are >= 0: max(got)
                        count[p, kind, mb] += 1
                        link[d] = t
                busy += end - start
                clock[d] = end
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    return clock, link, last_grad, busy, log_i[:n_log], log_t[:n_log], sends[:n_send]
