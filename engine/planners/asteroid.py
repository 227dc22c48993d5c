"""Asteroid planner: exact dynamic programming over layer ranges, device groups and stage count.

The published planner orders devices by memory and gives each stage a contiguous run of that order.
Here, while the cluster is small enough (EXACT_LIMIT), a stage's group is any multiset of device
*classes* (devices with the same kind, memory and speed are interchangeable), so the search covers
every assignment of devices to stages and finds the true optimum of the cost model; larger clusters
fall back to the published space. For each micro-batch count M the DP is over suffixes:

    best(i, r, k) = fronts of (max stage time, sum of stage times, max all-reduce) for covering
                    layers [i, L) with exactly k stages drawn from the device counts r,

and the iteration time sum + (M - 1) * max + allreduce is minimized at the top (the DP itself runs compiled:
engine.planners.kernel). A front keeps only
entries that no other beats for every way of finishing the plan. Inside a stage the micro-batch is
split by `allocation.allocate` (proportional to speed, capped by memory, samples moved off the
straggler). k is there only because stage p of S holds min(S - p, M) micro-batches of activations:
the search first solves the relaxation that charges every stage one (no k in the state) and keeps
its plan when that plan fits the real memory; otherwise it runs the full DP.

Every search is bounded: a plan of iteration time T has every stage below T / M, and the layers
before and after a stage need at least their work over their devices' speed, so a DP run with
bound T finds exactly the plans with iteration time <= T, and prunes the rest early (a forward and a
backward pass first bound what the stages before and after each state take, `bounds.bounds`). The bound steps up
from the lower bound (total work over total speed) toward the best data-parallel plan (and, on an exact search
past ORDERED_FIRST pairs, the ordered search's optimum, whose count leads); the first round that finds a plan has
found the optimum. Each round of the leading micro-batch count first searches with fronts cut to BEAM entries, and
bounds its exact round by the plan that finds.

That optimum is of the closed form, which charges sends as if they held their device up and every stage's
whole time to the pipeline's fill and drain, so it over-predicts, most where sends are long or the slowest
stage comes early. Unless the problem says `rank=False`, the plan returned is then the one the event-driven
simulator (engine.simulator, which follows the runtime's 1F1B within a few per cent) runs fastest among the
closed form's near-optima (`_rank`).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from engine.allocation import allocate
from engine.costmodel import allreduce_s, stage_terms
from engine.plan import Plan, Share, Stage
from engine.planners import baselines, kernel, stagecosts
from engine.planners.common import (
    NoFeasiblePlan,
    Problem,
    device_classes,
    fastest_few,
    finish,
    scheduled,
    simulated,
)
from engine.planners.refine import refine
from engine.progress import Progress

SLACK = 1 + 1e-9  # float headroom on bounds, so a plan exactly at the cap is never cut
# Past this many (remaining, group) pairs the exact search is too slow; groups are then contiguous runs
# of the memory order, as in the published planner (still every layer range, stage count and share). 16 boards of
# three kinds (6/5/5: 12,348 pairs) or 24 of two (12/12: 8,281) plan in under 2 s at 200 layers (docs/benchmarks.md).
EXACT_LIMIT = 12500
GROWTH = 1.3  # without an upper bound, how much the iteration-time bound loosens per round
STEP = 0.3  # fraction (in log scale) of the way from the lower to the upper bound each round
LEAD_GROWTH = 1.2  # how much the bound loosens per round while only the leading micro-batch count is searched
NEAR_GROWTH = 1.05  # ... in a re-plan, from the previous plan's time up
CLOSE = 0.05  # step until the bounds are this close, then search up to the upper bound
# The final choice (`_rank`): the plans whose closed-form time is at most the optimum's simulated time over
# RANK_RATIO (below the simulated / closed-form ratio of every reproduction plan, 0.79 and up; the random test
# instances reach 0.67), at most RANK_KEEP per micro-batch count and RANK_PLANS in all (the closed form's
# fastest), simulated.
RANK_RATIO, RANK_KEEP, RANK_PLANS = 0.75, 3, 8
# Where ranked, the REFINED fastest ranked plans have their cuts refined (engine.planners.refine, cut moves alone:
# cheap), and the fastest of them is then refined by every move: the best of the ranking is not always the one a
# few moves improve most (MobileNetV2 on B: the third, 6 % slower, is two cuts from a plan 5 % faster than the
# first's refinement; on another host's profiles the closed form's fastest plan, simulated fourth, is three cuts from a
# plan 3 % faster than the refinement of the first three). A re-plan waits for every simulation of it. Over A-D's 40
# cells, the 5 fastest against the 3 fastest made 4 plans 2-3 % faster, none slower; the 8 fastest, no more.
REFINED = 5
# GPipe's and FTPipeHD's plans join the ranking on clusters the exact search covers, up to this many layers
# (every zoo model): past it FTPipeHD's chain DP takes longer than the search itself (1.5 s at 9 x 100 here).
# PipeDream's planner costs seconds even on small clusters and is left out.
RIVALS_MAX_LAYERS = 50
# The near-optima are searched for (a search with a looser bound, costly: 8 x 20 took 5x the search itself)
# only up to this search size (every A-D cluster: 21-180) and RIVALS_MAX_LAYERS.
RANK_SEARCH_LIMIT = 200
# Exact searches larger than this are bounded from above by the ordered search's optimum first (`plan`).
ORDERED_FIRST = 1000
THREADS = min(8, os.cpu_count() or 1)  # micro-batch counts searched at once
# Each round of the ordered search's leading count first searches keeping this many entries of each state's front: a
# plan within about 1 % of the optimum (64 and 128 boards x 200 layers) at a fraction of the full round's cost, whose
# time then bounds the full round. A full round costs more the further its bound is above the optimum (64 x 200: 0.25 s
# at the optimum, 0.45 s 2 % above it, 2.2 s 10 % above it). The exact search's rounds go without: there the bounding
# passes, which a beam does not shorten, take most of a round (16 x 100 bounded by the ordered optimum, 6 % above its
# own: 0.21 s whole, 0.20 s with a beam of 16, then 0.10 s more for the round at that plan's time).
BEAM = 16


class _Search:
    """One DP for a fixed micro-batch count."""

    def __init__(self, problem: Problem, micro_batches: int, exact: bool, shared: dict | None = None):
        self.exact = exact
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
        self.tables: stagecosts.Tables | None = None  # built on the first search
        # What does not depend on the micro-batch count, shared by the searches of one problem.
        self.shared = shared = {} if shared is None else shared
        self.terms_cache: dict = shared.setdefault("terms", {})

    def terms(self, k: int, i: int, j: int, in_flight: int):
        key = (k, i, j, in_flight)
        if key not in self.terms_cache:
            self.terms_cache[key] = stage_terms(self.w, self.cluster, self.classes[k][0], i, j, in_flight, self.levels)
        return self.terms_cache[key]

    def split(self, i: int, j: int, g: tuple[int, ...], in_flight: int):
        """(time, all-reduce, per-class shares) of the best memory-capped split (`allocation.allocate`)."""
        ks = [k for k, c in enumerate(g) if c]
        res = allocate([self.terms(k, i, j, in_flight) for k in ks], [g[k] for k in ks], self.m)
        if res is None:
            return None
        return res[0], self.allreduce_of(i, j, g), dict(zip(ks, res[1]))

    def allreduce_of(self, i: int, j: int, g: tuple[int, ...]) -> float:
        """`costmodel.allreduce_s` of layers [i, j) across group g, at its slowest link."""
        _rate, k = min(self.links[k] for k, c in enumerate(g) if c)  # the slowest class's link and index
        return allreduce_s(self.w, self.cluster, i, j, sum(g), self.allreduce, (self.classes[k][0].name,))

    def run(self, cap: float, relaxed: bool = False, stages: int = 0, beam: int = -1) -> tuple[float, list] | None:
        """Best plan with iteration time <= M * cap (of exactly `stages` stages if given): (time,
        [(i, j, g, shares)]) or None. `beam` > 0 keeps only that many entries of each state's front (those of least
        key): a plan found is then within the bound but not always the best, and None is no proof that none is."""
        found = self.several(cap, relaxed, stages, keep=1, beam=beam)
        return found[0] if found else None

    def several(
        self, cap: float, relaxed: bool = False, stages: int = 0, keep: int = 1, beam: int = -1
    ) -> list[tuple[float, list]]:
        """Up to `keep` plans with iteration time <= M * cap, fastest first: the best, then the next entries of
        the fronts at the top (each the fastest way to its own (max, sum, all-reduce) trade-off).

        `relaxed` charges every stage one in-flight micro-batch of activations instead of its 1F1B
        count: a weaker memory constraint, so no worse than the truth, and the state needs no stage
        count. The caller checks the plan it gives against the real memory.
        """
        if self.tables is None:
            self.tables = stagecosts.tables(self)
        L, full = self.L, tuple(len(c) for c in self.classes)
        ks = [0] if relaxed else [stages] if stages else list(range(1, min(sum(full), L) + 1))
        allowed = np.ones((max(ks) + 1, L + 1), dtype=np.bool_)  # stages may end after any layer
        states, strides = self.states()
        times, tops, entries, ends, groups, links = kernel.front_search(
            self.tables, self.M * cap * SLACK, cap * SLACK, np.array(ks, dtype=np.int64), max(ks), allowed,
            states, strides, not self.exact, keep, beam,
        )  # fmt: skip
        found = []
        radix, g = np.array(full, dtype=np.int64), np.zeros(len(full), dtype=np.int64)
        for t, k, e in zip(times.tolist(), tops.tolist(), entries.tolist()):
            stages_, i, left = [], 0, radix.copy()
            while e >= 0:
                stagecosts.group_of(int(groups[e]), strides, radix, left, not self.exact, g)
                left -= g
                j = int(ends[e])
                group = tuple(int(c) for c in g)
                stages_.append((i, j, group, self.split(i, j, group, min(k, self.M) if k else 1)[2]))
                i, e, k = j, int(links[e]), (k - 1 if k else 0)
            found.append((t, stages_))
        return found

    def states(self) -> tuple[np.ndarray, np.ndarray]:
        """The DP's states (devices left per class, numbered by the devices used: the whole cluster is 0) and the
        mixed-radix strides that number a group (`stagecosts.group_code`). Exact: every count vector; ordered: the
        memory order's suffixes (a group is numbered by its size there, and the strides are all 1)."""
        key = ("states", self.exact)
        if key not in self.shared:
            full = np.array([len(c) for c in self.classes], dtype=np.int64)
            strides = np.ones(len(full), dtype=np.int64)
            for k in range(len(full) - 2, -1, -1) if self.exact else ():  # ordered: no code needs them
                strides[k] = strides[k + 1] * (full[k + 1] + 1)
            if self.exact:
                codes = np.arange(int(np.prod(full + 1)))
                states = full - (codes[:, None] // strides) % (full + 1)
            else:  # the first d devices of the memory order used
                before = np.concatenate([[0], np.cumsum(full)[:-1]])  # devices of the classes ahead of each
                used = np.clip(np.arange(full.sum() + 1)[:, None] - before, 0, full)
                states = full - used
            self.shared[key] = (np.ascontiguousarray(states, dtype=np.int64), strides)
        return self.shared[key]

    def lower_bound(self) -> float:
        """No stage can beat the whole cluster working in perfect proportion."""
        return (self.Wp[self.L] - self.Wp[0]) * self.m / sum(len(c) * s for c, s in zip(self.classes, self.speed))


def search_size(cluster, w=None) -> int:
    """Number of (remaining devices, stage group) pairs the exact search visits per layer pair."""
    return math.prod((n + 1) * (n + 2) // 2 for n in map(len, device_classes(cluster, w)))


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
    """The fastest plan under the cost model that fits every device's memory (`progress`: a bar per round)."""
    size = search_size(problem.cluster, problem.workload)
    exact = size <= EXACT_LIMIT
    # Most micro-batches first: they usually win, and a plan found early tightens the bound for the rest.
    options = list(reversed(problem.micro_batch_options))

    def lead(count: int) -> None:
        if count in options:
            options.insert(0, options.pop(options.index(count)))

    if problem.previous is not None:  # a re-plan: its count first
        lead(problem.previous.micro_batches)
    shared: dict = {}
    # The published planner's space is inside the exact one and costs a small part of its search: its optimum, 3-8 %
    # above the exact optimum from 10 to 24 boards, bounds the exact search from above before its first round, and
    # its count leads. It also joins the ranking: the simulator may run it faster than the closed form's optimum.
    upper, ordered = None, []
    if exact and size > ORDERED_FIRST:
        upper, search, layout = _optimise(problem, [_Search(problem, M, False, shared) for M in options], progress)
        ordered.append(finish(problem, "asteroid", search.M, _to_stages(search, layout)))
        lead(search.M)
    searches = [_Search(problem, M, exact, shared) for M in options]
    found = _optimise(problem, searches, progress, upper)
    best = finish(problem, "asteroid", found[1].M, _to_stages(found[1], found[2]))
    if not problem.rank:
        return best if problem.schedule in ("auto", "1f1b") else scheduled(best, problem.workload, problem.schedules)
    return _rank(problem, searches, best, exact, progress, ordered)


def _rank(
    problem: Problem, searches: list[_Search], best: Plan, exact: bool, progress: bool, others: list[Plan]
) -> Plan:
    """Of the plans that may simulate faster than the closed form's optimum `best` (closed-form time up to its
    simulated time / RANK_RATIO; the RANK_KEEP fastest of each micro-batch count that fit; searched for up to
    RANK_SEARCH_LIMIT), `others` (plans other searches of the problem found) and, on a cluster small enough for the
    exact search and a model of at most RIVALS_MAX_LAYERS, GPipe's and FTPipeHD's plans (inside this planner's
    space), the one the event-driven simulator runs fastest; `best` on a tie (and, past those limits and with no
    `others`, `best` itself, simulated). Each candidate is simulated under every schedule the problem allows
    (engine.schedule; the fastest that fits), and, within the same limits, the REFINED fastest have their cuts refined
    and the fastest of them is refined by every single move (engine.planners.refine).

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
    for other in others:  # plans of the problem found by other searches (the ordered one's optimum)
        found.setdefault((other.micro_batches, other.stages), other)
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
    w = problem.workload
    memo: dict = {}  # the stages the simulations below worked out (costmodel.score, steps.device_steps)
    fastest = fastest_few(ranked, w, problem.schedules, REFINED, memo)
    if not (problem.refine and fastest[0].predicted.fits and near):  # refined where ranked: small enough to simulate
        return fastest[0]
    seen: dict = {}
    cut = [refine(p, w, cuts_only=True, seen=seen, memo=memo) for p in fastest if p.predicted.fits]
    chosen = min(cut, key=lambda p: p.predicted.simulated_s)  # the first on a tie
    return scheduled(refine(chosen, w, seen=seen, memo=memo), w, problem.schedules, memo)


def _optimise(problem: Problem, searches: list[_Search], progress: bool, upper: float | None = None) -> tuple:
    """The best (time, search, layout) over every micro-batch count, in rounds of loosening bounds (`upper`: the time
    of a plan known to be in the search's space that fits, which bounds the rounds from above).

    In the ordered search, a round of the leading count first runs a search that keeps BEAM entries per state: when
    that finds a plan, the full round is bounded by its time, about 1 % above the optimum, instead of by the round's
    bound. A re-plan (`problem.previous`) first bounds the leading count by about the previous plan's time
    (`_first_guess`), where the new optimum usually is within a few per cent, and then loosens by NEAR_GROWTH up to
    LEAD_GROWTH above it. Past that it steps on as any search does."""
    # A round searches for plans with T <= bound; the best plan of the first round that finds any is optimal, as
    # every better plan was inside the bound too. Total work over total speed bounds T from below; data
    # parallelism, when it fits, from above. Step between them geometrically, close to the lower bound: a round
    # that finds nothing is cheap, a round with a loose bound is slow. The rounds search the leading micro-batch
    # count (the most: usually the best) alone; once it has a plan, one round over every count bounded by that
    # plan's time finds the optimum. Ruling a count out costs a search each, so it is done once, at a tight bound.
    floor = lo = min(s.lower_bound() * s.M for s in searches)
    hi = _data_parallel_time(problem) if upper is None else min(upper, _data_parallel_time(problem))
    pool = searches[:1]
    rounds = 0
    previous = problem.previous.predicted.iteration_s if problem.previous and problem.previous.predicted else None
    guess = _first_guess(problem) if previous is not None and lo < previous < hi else None
    while True:
        rounds += 1
        if guess is not None and guess < previous * LEAD_GROWTH and pool is not searches:
            bound = min(guess, hi)
            guess *= NEAR_GROWTH
        elif math.isinf(hi):
            bound = lo * GROWTH if lo < 1e3 * floor else math.inf  # far above the floor: search everything
        elif hi / lo <= 1 + CLOSE:
            bound = hi
        elif pool is not searches:
            bound = min(lo * LEAD_GROWTH, hi)
        else:
            bound = lo * (hi / lo) ** STEP
        label = f"planning, round {rounds}: iterations <= {bound:.3g} s"
        if pool is not searches and not pool[0].exact:  # the ordered search's leading count: a beam search first
            sketch = pool[0].run(bound / pool[0].M, relaxed=True, beam=BEAM)
            # the full search with that plan's time as its bound finds the optimum (unless the plan does not fit the
            # real memory: a round up to lo found none that does, so a sketch within lo is of no use)
            if sketch is not None and sketch[0] > lo:
                bound = sketch[0]
                label = f"planning, round {rounds}: iterations <= {bound:.3g} s"
            elif bound < hi:  # no proof that no plan is within the bound, but the next round's is looser
                lo = bound
                continue
        found = _feasible_round(problem, pool, bound, label, progress)
        if found and pool is not searches:
            return _the_other_counts(problem, searches[1:], found, progress)
        if found:
            return found
        if bound >= hi:
            if pool is not searches:  # the leading count has no plan: search every count from the floor
                pool, lo = searches, floor
                continue
            raise NoFeasiblePlan(
                f"model {problem.workload.model!r} at batch size {problem.batch_size} does not fit in the memory "
                f"of {problem.cluster.label}"
            )
        lo = bound


def _first_guess(problem: Problem) -> float:
    """A re-plan's first bound: the previous plan's time, over the share of its devices' speed still in the cluster,
    at most NEAR_GROWTH above it. After a loss or a leave the new optimum is slower (64 boards x 50 layers less an
    NX: 1.0 %; every plan of fewer boards was open to the previous search), so a first round at the previous time
    only finds nothing (a quarter of a second there); after a join or a re-partition it is the previous time."""
    prev = problem.previous
    here = {d.name for d in problem.cluster.devices}
    speeds = {
        s.name: problem.workload.speed_bound(prev.cluster.device(s.name)) for st in prev.stages for s in st.devices
    }
    kept = sum(v for name, v in speeds.items() if name in here)
    ratio = sum(speeds.values()) / kept if kept else NEAR_GROWTH
    return prev.predicted.iteration_s * min(ratio, NEAR_GROWTH)


def _the_other_counts(problem: Problem, searches: list[_Search], found: tuple, progress: bool) -> tuple:
    """The best of `found` (the leading count's optimum) and the other counts' plans, each search bounded by the best
    plan found before it: one count at a time while each finds a faster plan than the one before (the optimum is
    moving toward fewer micro-batches), then the rest side by side. A count whose optimum is far below the leading
    count's (MobileNetV2 on 64 boards: 4 micro-batches at 0.053 s against 64 at 0.125 s) is then searched with a
    bound near its own optimum instead of the leading count's (there, the search of 4 micro-batches took 2.0 s
    bounded by 0.125 s and 0.07 s bounded by 0.055 s). On a tie the count listed first wins, as if every count had
    been searched with one bound."""
    best, rest = found, list(searches)
    while rest:
        label = f"planning, {rest[0].M} micro-batches: iterations <= {best[0]:.3g} s"
        other = _feasible_round(problem, rest[:1], best[0], label, progress)
        rest = rest[1:]
        if not (other and other[0] < best[0]):
            break
        best = other
    if rest:
        label = f"planning, every other micro-batch count: iterations <= {best[0]:.3g} s"
        other = _feasible_round(problem, rest, best[0], label, progress)
        if other and other[0] < best[0]:
            best = other
    return best


def _feasible_round(problem: Problem, searches: list[_Search], bound: float, label: str, progress: bool):
    """The best (time, search, layout) with time <= bound that fits the real memory, or None: the relaxation's
    optimum when it fits (then it is the optimum), else the full-memory search's."""
    found = _round(searches, bound, relaxed=True, label=label, progress=progress)
    if found:
        plan = finish(problem, "asteroid", found[1].M, _to_stages(found[1], found[2]))
        if plan.predicted.fits:
            return found
        found = _round(searches, bound, relaxed=False, label=label + " (full memory)", progress=progress)
    return found


def _round(searches: list[_Search], bound: float, relaxed: bool, label: str, progress: bool):
    """Best (time, search, layout) over every micro-batch count with time <= bound, or None. The searches run
    side by side on up to THREADS cores (the compiled search releases the interpreter lock); on a tie the count
    listed first wins, as if they had run one after the other."""
    best = None
    with Progress(len(searches), label, enabled=progress) as bar, ThreadPoolExecutor(THREADS) as pool:
        running = [pool.submit(search.run, bound / search.M, relaxed) for search in searches]
        for search, future in zip(searches, running):
            found = future.result()
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
