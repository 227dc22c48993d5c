"""Asteroid planner: exact dynamic programming over layer ranges, device groups and stage count.

The published planner orders devices by memory and gives each stage a contiguous run of that order.
Here, while the cluster is small enough (EXACT_LIMIT), a stage's group is any multiset of device
*classes* (devices with the same kind, memory and speed are interchangeable), so the search covers
every assignment of devices to stages and finds the true optimum of the cost model; larger clusters
fall back to the published space. For each micro-batch count M the DP is over suffixes:

    best(i, r, k) = fronts of (max stage time, sum of stage times, max all-reduce) for covering
                    layers [i, L) with exactly k stages drawn from the device counts r,

and the iteration time sum + (M - 1) * max + allreduce is minimized at the top. A front keeps only
entries that no other beats for every way of finishing the plan. Inside a stage the micro-batch is
split by `costmodel.allocate` (proportional to speed, capped by memory, samples moved off the
straggler). k is there only because stage p of S holds min(S - p, M) micro-batches of activations:
the search first solves the relaxation that charges every stage one (no k in the state) and keeps
its plan when that plan fits the real memory; otherwise it runs the full DP.

Every search is bounded: a plan of iteration time T has every stage below T / M, and the layers
before and after a stage need at least their work over their devices' speed, so a DP run with
bound T finds exactly the plans with iteration time <= T, and prunes the rest early. The bound
steps up from the lower bound (total work over total speed) toward the best data-parallel plan; the
first round that finds a plan has found the optimum.

That optimum is of the closed form, which charges sends as if they held their device up and every stage's
whole time to the pipeline's fill and drain, so it over-predicts, most where sends are long or the slowest
stage comes early. Unless the problem says `rank=False`, the plan returned is then the one the event-driven
simulator (engine.simulator, which follows the runtime's 1F1B within a few per cent) runs fastest among the
closed form's near-optima (`_rank`).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from dataclasses import replace

from engine.costmodel import allocate, allreduce_s, boundary_s, stage_fixed_s, stage_terms
from engine.plan import OFF, Plan, Share, Stage
from engine.planners import baselines
from engine.planners.common import NoFeasiblePlan, Problem, device_classes, finish, simulated
from engine.progress import Progress

SLACK = 1 + 1e-9  # float headroom on bounds, so a plan exactly at the cap is never cut
# Past this many (remaining, group) pairs the exact search is too slow; groups are then contiguous runs
# of the memory order, as in the published planner (still every layer range, stage count and share).
EXACT_LIMIT = 1000
GROWTH = 1.3  # without an upper bound, how much the iteration-time bound loosens per round
STEP = 0.3  # fraction (in log scale) of the way from the lower to the upper bound each round
CLOSE = 0.05  # step until the bounds are this close, then search up to the upper bound
# Deeper models first get an upper bound from a blocked search (see `plan`): cuts between this many blocks.
DEEP_LAYERS, LAYER_BLOCKS = 100, 24
REFINE_PASSES = 4  # at most this many rounds of moving the blocked plan's cuts
# The final choice (`_rank`): the plans whose closed-form time is at most the optimum's simulated time over
# RANK_RATIO (below the simulated / closed-form ratio of every reproduction plan, 0.79 and up; the random test
# instances reach 0.67), at most RANK_KEEP per micro-batch count and RANK_PLANS in all (the closed form's
# fastest), simulated.
RANK_RATIO, RANK_KEEP, RANK_PLANS = 0.75, 3, 8
# GPipe's and FTPipeHD's plans join the ranking on clusters the exact search covers, up to this many layers
# (every zoo model): past it FTPipeHD's chain DP takes longer than the search itself (1.5 s at 9 x 100 here).
# PipeDream's planner costs seconds even on small clusters and is left out.
RIVALS_MAX_LAYERS = 50
# The near-optima are searched for (a search with a looser bound, costly: 8 x 20 took 5x the search itself)
# only up to this search size (every A-D cluster: 21-180) and RIVALS_MAX_LAYERS.
RANK_SEARCH_LIMIT = 200


class _Search:
    """One DP for a fixed micro-batch count."""

    def __init__(self, problem: Problem, micro_batches: int, exact: bool, shared: dict | None = None, cuts=None):
        self.exact = exact
        # Where stages may end, besides the last layer: None (anywhere), a sorted list for every stage, or a
        # dict from the count of stages still to go (this one included) to such a list (or None).
        self.cuts = cuts
        self.w = problem.workload
        self.cluster = problem.cluster
        self.M = micro_batches
        self.m = problem.batch_size // micro_batches
        self.classes = device_classes(problem.cluster, self.w)
        # Rates no device of a class beats on any layer range: every bound below divides work by them.
        self.speed = [self.w.speed_bound(c[0]) for c in self.classes]
        # Each class's link (a board's own, else the cluster's): a stage's all-reduce runs at its slowest.
        self.links = [(self.cluster.link_mbps_of(c[0]), k) for k, c in enumerate(self.classes)]
        self.levels = (problem.compression, problem.compression)
        self.allreduce = problem.allreduce
        self.L = self.w.num_layers
        self.Wp = self.w.work_prefix
        self.costs: dict = {}
        self.free_costs: dict = {}
        self.moves_cache: dict = {}
        # What does not depend on the micro-batch count, shared by the searches of one problem.
        self.shared = shared = {} if shared is None else shared
        self.terms_cache: dict = shared.setdefault("terms", {})
        self.ranges: dict = shared.setdefault("ranges", {})
        self.allreduces: dict = shared.setdefault("allreduces", {})

    def speed_of(self, r: tuple[int, ...]) -> float:
        return sum(c * s for c, s in zip(r, self.speed))

    def moves(self, r: tuple[int, ...]) -> list:
        """Every group g <= r a stage may take (at most m devices, one sample each at least), as
        (g, its speed, what remains, its speed, its size, g's (count, speed) pairs)."""
        if r not in self.moves_cache:
            out = []
            for g in itertools.product(*(range(x + 1) for x in r)) if self.exact else _prefix_runs(r):
                if 0 < sum(g) <= self.m:
                    rest = tuple(a - b for a, b in zip(r, g))
                    pairs = [(c, s) for c, s in zip(g, self.speed) if c]
                    out.append((g, self.speed_of(g), rest, self.speed_of(rest), sum(rest), pairs))
            self.moves_cache[r] = out
        return self.moves_cache[r]

    def terms(self, k: int, i: int, j: int, in_flight: int):
        key = (k, i, j, in_flight)
        if key not in self.terms_cache:
            self.terms_cache[key] = stage_terms(self.w, self.cluster, self.classes[k][0], i, j, in_flight, self.levels)
        return self.terms_cache[key]

    def stage_cost(self, i: int, j: int, g: tuple[int, ...], in_flight: int) -> tuple[float, float] | None:
        """(time, all-reduce) of layers [i, j) on group g at its best split, or None if it cannot fit."""
        # in_flight only changes the memory caps: while the split that ignores memory fits them, it is
        # the optimum, whatever the stage's position. Keep it with the most in-flight micro-batches it fits.
        free = self.free_costs.get((i, j, g))
        if free is None:
            free = self.free_costs[(i, j, g)] = self._memory_free(i, j, g)
        if in_flight <= free[1]:
            return free[0]
        key = (i, j, g, in_flight)
        if key not in self.costs:
            found = self.split(i, j, g, in_flight)
            self.costs[key] = None if found is None else found[:2]
        return self.costs[key]

    def split(self, i: int, j: int, g: tuple[int, ...], in_flight: int):
        """(time, all-reduce, per-class shares) of the best memory-capped split (`costmodel.allocate`)."""
        ks = [k for k, c in enumerate(g) if c]
        res = allocate([self.terms(k, i, j, in_flight) for k in ks], [g[k] for k in ks], self.m)
        if res is None:
            return None
        return res[0], self.allreduce_of(i, j, g), dict(zip(ks, res[1]))

    def allreduce_of(self, i: int, j: int, g: tuple[int, ...]) -> float:
        """`costmodel.allreduce_s` of layers [i, j) across group g, at its slowest link, computed once."""
        n = sum(g)
        rate, k = min(self.links[k] for k, c in enumerate(g) if c)  # the slowest class's link and index
        key = (i, j, n, rate)
        found = self.allreduces.get(key)
        if found is None:
            names = (self.classes[k][0].name,)
            found = self.allreduces[key] = allreduce_s(self.w, self.cluster, i, j, n, self.allreduce, names)
        return found

    def _memory_free(self, i: int, j: int, g: tuple[int, ...]) -> tuple:
        """((time, all-reduce) of the best split ignoring memory, the most in-flight micro-batches at which
        every device still fits it).

        With identical devices per class the optimum has a closed form: every device's time is fixed +
        n * c_k, so the stage time is fixed + t for the least t on some class's grid q * c_k with
        sum_k count_k * floor(t / c_k) >= m, at least one sample per device. t lies between the
        fractional water level and that plus one sample of the slowest class; the same products as
        `costmodel.allocate`'s, so the times agree exactly.
        """
        m = self.m
        fixed, static, saved, peak, per_class = self._range(i, j)
        per = [(k, n, per_class[k]) for k, n in enumerate(g) if n]
        if len(per) == 1:  # one class: every device takes ceil(m / n) samples (what the loop below finds)
            best = -(-m // per[0][1]) * per[0][2]
        else:
            lowest = max(m / sum(n / c for _k, n, c in per), max(c for _k, _n, c in per))
            best = math.inf
            for _k, _n, c in per:
                q = max(1, math.ceil(lowest / c - 1e-9))
                while q * c < best:
                    t = q * c
                    if sum(n * min(m, math.floor(t / c2 + 1e-9)) for _k2, n, c2 in per) >= m:
                        best = t
                        break
                    q += 1
        cost = (fixed + best, self.allreduce_of(i, j, g))
        most = 1 << 30
        for k, _n, c in per:
            n = min(m, math.floor(best / c + 1e-9))  # no device of the class holds more than this
            spare = self.classes[k][0].memory_bytes - static - n * peak
            if spare < 0:
                return cost, 0
            if saved:
                most = min(most, spare // (n * saved))
        return cost, most

    def _range(self, i: int, j: int) -> tuple:
        """What a stage over layers [i, j) costs whatever its group (computed once per range): its fixed time,
        static, saved and peak bytes, and each class's seconds per sample (what stage_terms gives `allocate`)."""
        found = self.ranges.get((i, j))
        if found is None:
            w, cluster = self.w, self.cluster
            per_class = [
                max(w.compute_s(c[0], i, j) + boundary_s(w, cluster, c[0], i, j, self.levels), 1e-15)
                for c in self.classes
            ]
            fixed = stage_fixed_s(cluster, j - i, (i > 0) + (j < self.L))
            found = self.ranges[(i, j)] = (fixed, w.static_bytes(i, j), w.saved(i, j), w.peak(i, j), per_class)
        return found

    def run(self, cap: float, relaxed: bool = False, stages: int = 0) -> tuple[float, list] | None:
        """Best plan with iteration time <= M * cap (of exactly `stages` stages if given): (time,
        [(i, j, g, shares)]) or None."""
        found = self.several(cap, relaxed, stages, keep=1)
        return found[0] if found else None

    def several(self, cap: float, relaxed: bool = False, stages: int = 0, keep: int = 1) -> list[tuple[float, list]]:
        """Up to `keep` plans with iteration time <= M * cap, fastest first: the best, then the next entries of
        the fronts at the top (each the fastest way to its own (max, sum, all-reduce) trade-off).

        `relaxed` charges every stage one in-flight micro-batch of activations instead of its 1F1B
        count: a weaker memory constraint, so no worse than the truth, and the state needs no stage
        count. The caller checks the plan it gives against the real memory.
        """
        M, m, L, Wp = self.M, self.m, self.L, self.Wp
        bound = M * cap * SLACK
        limit = cap * SLACK
        memo: dict = {}
        # compressed bytes at the fastest link (a bound for every device); their codec time is left out
        bw = max(rate for rate, _k in self.links) * 1e6 / 8 * OFF / self.levels[0]
        out = self.w.output_bytes
        a_in = [out[i - 1] / bw if i else 0.0 for i in range(L + 1)]  # comm per sample entering at layer i
        a_out = [out[j - 1] / bw if j < L else 0.0 for j in range(L + 1)]  # ... and leaving after layer j
        total_speed = sum(len(c) * s for c, s in zip(self.classes, self.speed))
        per_layer, per_boundary = stage_fixed_s(self.cluster, 1, 0), stage_fixed_s(self.cluster, 0, 1)  # linear

        def suffix(i: int, r: tuple[int, ...], k: int) -> list:
            """Front for layers [i, L) on devices within r in exactly k stages (any number if k == 0)."""
            key = (i, r, k)
            front = memo.get(key)
            if front is not None:
                return front
            entries = []
            in_flight = min(k, M) if k else 1
            # The stages before i ran layers [0, i) on the devices not in r: their times sum to at least
            # this, so the suffix's (M - 1) max + sum + all-reduce must fit in what is left of the bound.
            # Their longest stage takes at least as long too (each stage's time is at least its share of
            # that work over its share of the speed), and so for the stages from i on, on the devices in r.
            Wi, Wl = Wp[i], Wp[L]
            up = Wi * m / (total_speed - self.speed_of(r)) if i else 0.0
            us = (Wl - Wi) * m / self.speed_of(r)
            if (M - 1) * (up if up > us else us) + up + us > bound:
                memo[key] = front = []
                return front
            room = bound - up
            tail = (M - 1) * up  # at least this much of the (M - 1) max is the prefix's
            after = max(k - 1, 1)  # stages that must follow a middle stage
            cuts = self.cuts.get(k) if isinstance(self.cuts, dict) else self.cuts
            for g, sg, rest, sr, n_rest, classes in self.moves(r):
                lo, hi = L + 1, L - 1  # empty range of middle-stage ends unless some can follow
                if k != 1 and n_rest >= after:
                    hi = min(bisect_right(Wp, Wi + limit * sg / m) - 1, L - after)
                    lo = max(bisect_left(Wp, Wl - limit * sr / m), i + 1)
                ends = range(lo, hi + 1) if cuts is None else cuts[bisect_left(cuts, lo) : bisect_right(cuts, hi)]
                if k <= 1 and (Wl - Wi) * m <= limit * sg:
                    ends = [*ends, L]  # the last stage too
                for j in ends:
                    # This stage is M of the iteration's stage-times; the stages after it at least rest_s,
                    # their longest too; and the (M - 1) max is at least the prefix's or the rest's.
                    rest_s = (Wl - Wp[j]) * m / sr if j < L else 0.0
                    most = tail if tail > (M - 1) * rest_s else (M - 1) * rest_s
                    u_max = min((room - rest_s) / M, room - rest_s - most)
                    work, comm = Wp[j] - Wi, a_in[i] + a_out[j]
                    # Every device pays the same fixed cost; the rest is at best split in proportion.
                    fixed = (j - i) * per_layer + ((i > 0) + (j < L)) * per_boundary
                    if (m / sum(c / (work / s + comm) for c, s in classes)) + fixed > u_max:
                        continue  # even a perfect split of the samples is too slow
                    cost = self.stage_cost(i, j, g, in_flight)
                    if cost is None or cost[0] > u_max:
                        continue
                    u, ar = cost[0], cost[1]
                    if j == L:
                        if (M - 1) * (u if u > up else up) + u + ar <= room:
                            entries.append((u, u, ar, j, g, -1))
                        continue
                    lim = room - u
                    floor = u if u > up else up
                    for idx, (U2, S2, A2, *_rest) in enumerate(suffix(j, rest, k - 1 if k else 0)):
                        U, A = (u if u > U2 else U2), (ar if ar > A2 else A2)
                        if (M - 1) * (U if U > floor else floor) + S2 + A <= lim:
                            entries.append((U, u + S2, A, j, g, idx))
            memo[key] = front = _pareto(entries, M)
            return front

        full = tuple(len(c) for c in self.classes)
        tops = []
        for k in [0] if relaxed else [stages] if stages else range(1, min(sum(full), L) + 1):
            for idx, (U, S, A, *_rest) in enumerate(suffix(0, full, k)):
                tops.append((S + (M - 1) * U + A, k, idx))
        return [(t, self._layout(memo, full, k, idx)) for t, k, idx in sorted(tops)[:keep]]

    def _layout(self, memo: dict, full: tuple[int, ...], k: int, idx: int) -> list:
        """The stages [(i, j, g, shares)] of the front entry `idx` of (0, full, k), following its links."""
        stages, i, r = [], 0, full
        while True:
            _U, _S, _A, j, g, nxt = memo[(i, r, k)][idx]
            stages.append((i, j, g, self.split(i, j, g, min(k, self.M) if k else 1)[2]))
            if nxt < 0:
                return stages
            i, r, k, idx = j, tuple(a - b for a, b in zip(r, g)), (k - 1 if k else 0), nxt

    def lower_bound(self) -> float:
        """No stage can beat the whole cluster working in perfect proportion."""
        return (self.Wp[self.L] - self.Wp[0]) * self.m / sum(len(c) * s for c, s in zip(self.classes, self.speed))


def _prefix_runs(r: tuple[int, ...]):
    """The first t remaining devices in memory order, for every t (the published Asteroid space)."""
    g = [0] * len(r)
    for k, x in enumerate(r):
        for _ in range(x):
            g[k] += 1
            yield tuple(g)


def search_size(cluster, w=None) -> int:
    """Number of (remaining devices, stage group) pairs the exact search visits per layer pair."""
    return math.prod((n + 1) * (n + 2) // 2 for n in map(len, device_classes(cluster, w)))


def _pareto(entries: list, M: int) -> list:
    """Entries no other entry beats for every way of finishing the plan.

    Finishing adds stages with time x and all-reduce y to both: the objective (M - 1) max(U, x) + S +
    max(A, y) of e1 never exceeds e2's iff S1 + (M - 1)(U1 - U2)+ + (A1 - A2)+ <= S2. A dominating
    entry has the smaller partial objective, so scanning in that order only checks kept entries.
    """
    entries.sort(key=lambda e: (M - 1) * e[0] + e[1] + e[2])
    kept: list = []
    for e in entries:
        U, S, A = e[0], e[1], e[2]
        for k in kept:
            du, da = k[0] - U, k[2] - A
            if k[1] + (M - 1) * (du if du > 0 else 0.0) + (da if da > 0 else 0.0) <= S:
                break
        else:
            kept.append(e)
    return kept


def _to_stages(search: _Search, layout: list) -> list[Stage]:
    """Name the devices: class members in name order, each stage taking the next ones."""
    pools = [list(c) for c in search.classes]
    stages = []
    for i, j, g, shares in layout:
        devs = []
        for k, count in enumerate(g):
            for n in shares.get(k, [])[:count]:
                devs.append(Share(pools[k].pop(0).name, n))
        stages.append(Stage(i, j, tuple(devs)))
    return stages


def plan(problem: Problem, progress: bool = False) -> Plan:
    """The fastest plan under the cost model that fits every device's memory (`progress`: a bar per round).

    A model deeper than DEEP_LAYERS is first planned with cuts only between LAYER_BLOCKS blocks of layers,
    then each cut of that plan moved within a block either way (`_refine`): a plan of the full space a few
    per cent from the optimum, found in a fraction of the time. One full search bounded by its time then
    finds the optimum, skipping the rounds below it and searching a much tighter bound than they would reach.
    """
    exact = search_size(problem.cluster, problem.workload) <= EXACT_LIMIT
    # Most micro-batches first: they usually win, and a plan found early tightens the bound for the rest.
    options = list(reversed(problem.micro_batch_options))
    shared: dict = {}
    upper = None
    if problem.workload.num_layers > DEEP_LAYERS:
        cuts = _block_cuts(problem)
        try:
            blocked = _optimise(problem, [_Search(problem, M, exact, shared, cuts) for M in options], progress)
            upper = _refine(problem, exact, cuts, blocked)
        except NoFeasiblePlan:
            pass  # no blocked plan fits; a plan with other cuts may: the full search says
    searches = [_Search(problem, M, exact, shared) for M in options]
    found = _optimise(problem, searches, progress, upper)
    best = finish(problem, "asteroid", found[1].M, _to_stages(found[1], found[2]))
    return _rank(problem, searches, best, exact, progress) if problem.rank else best


def _rank(problem: Problem, searches: list[_Search], best: Plan, exact: bool, progress: bool) -> Plan:
    """Of the plans that may simulate faster than the closed form's optimum `best` (closed-form time up to its
    simulated time / RANK_RATIO; the RANK_KEEP fastest of each micro-batch count that fit; searched for up to
    RANK_SEARCH_LIMIT) and, on a cluster small enough for the exact search and a model of at most
    RIVALS_MAX_LAYERS, GPipe's and FTPipeHD's plans (inside this planner's space), the one the event-driven
    simulator runs fastest; `best` on a tie (and, past those limits, `best` itself, simulated).

    The closed form charges every send as if it held its device up and every stage's whole time to the fill
    and drain, so it over-predicts, most where sends are long or the slowest stage comes early (the simulator
    says 0.67-1.0 of it on the test instances), while the simulator follows the runtime's 1F1B within a few
    per cent. Ranking near-optima by the simulator keeps the search on the fast closed form and picks what
    runs fastest; GPipe's and FTPipeHD's plans, shaped by other rules, are cheap on small clusters and sometimes
    overlap their sends better than any of the closed form's near-optima.
    """
    best = simulated(best, problem.workload)
    cap = best.predicted.simulated_s / RANK_RATIO
    found = {(best.micro_batches, best.stages): best}
    small = problem.workload.num_layers <= RIVALS_MAX_LAYERS
    near = small and search_size(problem.cluster, problem.workload) <= RANK_SEARCH_LIMIT
    with Progress(len(searches) if near else 0, "ranking the fastest plans by simulation", enabled=progress) as bar:
        for search in searches if near else []:
            for _t, layout in search.several(cap / search.M, relaxed=True, keep=RANK_KEEP):
                candidate = finish(problem, "asteroid", search.M, _to_stages(search, layout))
                if candidate.predicted.fits:
                    found.setdefault((candidate.micro_batches, candidate.stages), candidate)
            bar.update(note=f"{search.M} micro-batches")
    ranked = sorted(found.values(), key=lambda p: p.predicted.iteration_s)[:RANK_PLANS]
    if exact and small:
        for rival in (baselines.gpipe, baselines.ftpipehd):
            try:
                other = rival(problem)
            except NoFeasiblePlan:
                continue
            if other.predicted.fits and (other.micro_batches, other.stages) not in found:
                ranked.append(replace(other, method="asteroid"))
    return min((simulated(p, problem.workload) for p in ranked), key=lambda p: p.predicted.simulated_s)


def _optimise(problem: Problem, searches: list[_Search], progress: bool, upper: tuple | None = None) -> tuple:
    """The best (time, search, layout) over every micro-batch count, in rounds of loosening bounds; `upper`, a
    (time, ...) of a plan in the searches' space, bounds the first round."""
    # A round searches every M for plans with T <= bound; the best plan of the first round that finds
    # any is optimal, as every better plan was inside the bound too. Total work over total speed bounds
    # T from below; data parallelism, when it fits, from above. Step between them geometrically, close
    # to the lower bound: a round that finds nothing is cheap, a round with a loose bound is slow.
    floor = lo = min(s.lower_bound() * s.M for s in searches)
    hi = _data_parallel_time(problem)
    if upper is not None and upper[0] < hi:
        lo = hi = upper[0]  # one round up to that plan's time finds the optimum
    rounds = 0
    while True:
        rounds += 1
        if math.isinf(hi):
            bound = lo * GROWTH if lo < 1e3 * floor else math.inf  # far above the floor: search everything
        elif hi / lo <= 1 + CLOSE:
            bound = hi
        else:
            bound = lo * (hi / lo) ** STEP
        label = f"planning, round {rounds}: iterations <= {bound:.3g} s"
        found = _round(searches, bound, relaxed=True, label=label, progress=progress)
        if found:
            plan = finish(problem, "asteroid", found[1].M, _to_stages(found[1], found[2]))
            if plan.predicted.fits:
                return found  # the relaxation's optimum is feasible, so it is the optimum
            found = _round(searches, bound, relaxed=False, label=label + " (full memory)", progress=progress)
            if found:
                return found
        if bound >= hi:
            raise NoFeasiblePlan(
                f"model {problem.workload.model!r} at batch size {problem.batch_size} does not fit in the memory "
                f"of {problem.cluster.label}"
            )
        lo = bound


def _block_cuts(problem: Problem) -> list[int]:
    """LAYER_BLOCKS blocks of about equal work, each cut after its layer of smallest output (least to send)."""
    w, L = problem.workload, problem.workload.num_layers
    Wp = w.work_prefix
    edges = [0, *(bisect_left(Wp, Wp[L] * b / LAYER_BLOCKS) for b in range(1, LAYER_BLOCKS)), L]
    blocks = [range(max(a, 1), min(b, L - 1) + 1) for a, b in itertools.pairwise(edges)]
    return sorted({min(js, key=lambda j: w.output_bytes[j - 1]) for js in blocks if js})


def _refine(problem: Problem, exact: bool, cuts: list[int], found: tuple) -> tuple:
    """Move every cut of a blocked plan (time, search, layout) up to one block either way, all at once (same
    stage count and micro-batches, any groups); again around the new cuts while that helps."""
    L = problem.workload.num_layers
    reach = max(b - a for a, b in itertools.pairwise([0, *cuts, L]))
    for _ in range(REFINE_PASSES):
        time, search, layout = found
        P = len(layout)
        windows = {
            P - p: list(range(max(j - reach, 1), min(j + reach, L - 1) + 1))
            for p, (_i, j, *_) in enumerate(layout[:-1])
        }
        refined = _Search(problem, search.M, exact, search.shared, windows)
        better = refined.run(time / search.M, relaxed=False, stages=P)
        if better is None or better[0] >= time * (1 - 1e-9):
            break
        found = (better[0], refined, better[1])
    return found


def _round(searches: list[_Search], bound: float, relaxed: bool, label: str, progress: bool):
    """Best (time, search, layout) over every micro-batch count with time <= bound, or None."""
    best = None
    with Progress(len(searches), label, enabled=progress) as bar:
        for search in searches:
            found = search.run((best[0] if best else bound) / search.M, relaxed)
            if found and (best is None or found[0] < best[0]):
                best = (found[0], search, found[1])
            bar.update(note=f"{search.M} micro-batches")
    return best


def _data_parallel_time(problem: Problem) -> float:
    """Iteration time of the best data-parallel plan that fits (it is inside Asteroid's space), else inf."""
    try:
        dp_plan = baselines.dp(problem)
    except NoFeasiblePlan:
        return math.inf
    return dp_plan.predicted.iteration_s if dp_plan.predicted.fits else math.inf
