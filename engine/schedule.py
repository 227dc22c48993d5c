"""The 1F1B schedule as plain data: per stage, an ordered list of (stage, kind, micro-batch) actions.

With S stages and M micro-batches, stage s first runs min(S - s - 1, M) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. For S=3, M=4:

    stage 0:  F0 F1 F2    B0 F3 B1    B2 B3
    stage 1:  F0 F1    B0 F2 B1 F3 B2 B3
    stage 2:  F0 B0 F1 B1 F2 B2 F3 B3

Every device of a stage runs its stage's list on its own share of each micro-batch.

Zero-bubble schedules (Qi et al., ICLR'24) split each backward in two: B, the input gradient the previous
stage waits for, and W, the weight gradient, needed only before the optimizer step. W steps then fill the
bubbles. Asteroid's stages are unequal, so the lists are built from the plan's own step times (`zero_bubble`):
forwards and backwards keep 1F1B's order after a warm-up, and a replay of the pipeline puts each W where its
stage would otherwise wait, or where its cap of micro-batches held demands it. ZB-H1 keeps 1F1B's warm-up and
cap (the same activation memory); ZB-H2 about doubles both, to fill the warm-up bubble and to defer W into the
drain. The first stage sends no gradient back, so its whole backward is W.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# The schedules a plan may run; "1f1b" runs each backward whole, the others split it into B and W.
SCHEDULES = ("1f1b", "zb-h1", "zb-h2")
KINDS = ("F", "B", "W")


class Action(NamedTuple):
    """One step of a stage: "F" (forward), "B" (backward: whole, or its input gradient where the schedule splits
    it) or "W" (the weight gradient) of a micro-batch; string form "2F0"."""

    stage: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        for kind in KINDS:
            if kind in text:
                stage, mb = text.split(kind)
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"not an action: {text!r} (expected e.g. '2F0')")


def one_f_one_b(num_stages: int, micro_batches: int) -> dict[int, list[Action]]:
    """The synchronous 1F1B schedule (one flush per iteration) for every stage."""
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(f"need >= 1 stage and micro-batch, got {num_stages} and {micro_batches}")
    schedule = {}
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, micro_batches)
        acts = [Action(s, "F", mb) for mb in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < micro_batches:
            if fwd < micro_batches:
                acts.append(Action(s, "F", fwd))
                fwd += 1
            acts.append(Action(s, "B", bwd))
            bwd += 1
        schedule[s] = acts
    return schedule


def codes(num_stages: int, micro_batches: int, name: str, times: list[StageTimes] | None = None):
    """Every stage's list under schedule `name` as two S x n arrays: kinds (indices into KINDS) and micro-batches;
    a zero-bubble schedule needs the stages' step `times` (`zero_bubble`). Compiled: a device's process that runs
    1F1B never loads numba (about a second)."""
    from engine import simkernel

    S, M = num_stages, micro_batches
    if S < 1 or M < 1:
        raise ValueError(f"need >= 1 stage and micro-batch, got {S} and {M}")
    if name == "1f1b":
        return simkernel.one_f_one_b(S, M)
    if times is None or len(times) != S:
        raise ValueError(f"schedule {name!r} needs the step times of all {S} stages")
    if name == "zb-h1":
        return _replay(times, M, [S - s - 1 for s in range(S)], [in_flight(S, M, s) for s in range(S)])[1:]
    if name != "zb-h2":
        raise ValueError(f"not a schedule: {name!r}")
    warm = [2 * (S - s) - 2 for s in range(S)]
    tried = [_replay(times, M, warm, [max(2 * (S - s) - 1, S) for s in range(S)])]
    tried.append(_replay(times, M, warm, [in_flight(S, M, s, name) for s in range(S)]))
    return min(tried, key=lambda t: t[0])[1:]


def actions(kinds: np.ndarray, mbs: np.ndarray) -> dict[int, list[Action]]:
    """The Action lists of `codes`' arrays."""
    return {
        s: [Action(s, KINDS[k], m) for k, m in zip(ks, ms)]
        for s, (ks, ms) in enumerate(zip(kinds.tolist(), mbs.tolist()))
    }


def in_flight(num_stages: int, micro_batches: int, stage: int, name: str = "1f1b") -> int:
    """Most micro-batches whose activations stage `stage` holds at once under schedule `name` (a forward's
    activations are held until its backward, or its W where the backward is split)."""
    if name == "zb-h2":  # up to twice 1F1B's warm-up, and room on every stage to defer W into the drain
        return min(2 * num_stages - 1, micro_batches)
    return min(num_stages - stage, micro_batches)


class StageTimes(NamedTuple):
    """One stage's step times, as the list builder sees them: its slowest device's F, B (input gradient) and W
    (weight gradient), and how long its activations (forward) and input gradients (back) take to arrive."""

    forward: float
    backward: float
    weight: float
    send_forward: float
    send_backward: float


def zero_bubble(times: list[StageTimes], micro_batches: int, name: str = "zb-h1") -> dict[int, list[Action]]:
    """Per-stage lists of F, B and W actions for stages with these step times. Forwards and backwards keep
    1F1B's order, after `warm-up` forwards (ZB-H1: 1F1B's S - s - 1; ZB-H2: 2 (S - s) - 2, to fill the
    warm-up bubble); the W steps go where `_replay` finds the stage idle or its memory cap reached. ZB-H2 tries
    two caps (2 (S - s) - 1 but at least S, and 2 S - 1 everywhere) and keeps the lists that end first."""
    if name not in ("zb-h1", "zb-h2"):
        raise ValueError(f"not a zero-bubble schedule: {name!r}")
    return actions(*codes(len(times), micro_batches, name, times))


def _replay(times: list[StageTimes], M: int, warm: list[int], cap: list[int]) -> tuple[float, np.ndarray, np.ndarray]:
    """Replay the pipeline in time order, building each stage's list, and say when it ends. A free stage runs
    its next forward or backward (in 1F1B's order after warm[s] forwards) once its input or gradient is in and,
    for a forward, while it holds fewer than cap[s] micro-batches; else its oldest deferred W if that W would
    not hold up an input or gradient already on its way, or the cap demands it; else it waits. Stages move in
    order of (clock, stage). The loop runs compiled (engine.simkernel.replay)."""
    from engine import simkernel

    S = len(times)
    end, kinds, mbs = simkernel.replay(
        np.array(times, dtype=np.float64).reshape(S, 5), M, np.array(warm, np.int64), np.array(cap, np.int64)
    )
    if end < 0:
        raise RuntimeError("zero_bubble: no stage can move (a dependency is never met)")
    return end, kinds, mbs


def held(actions: list[Action]) -> int:
    """Most micro-batches a stage's list holds activations for at once (forwards not yet freed by their W, or by
    their backward where the list has no W)."""
    frees = "W" if any(a.kind == "W" for a in actions) else "B"
    now = peak = 0
    for a in actions:
        now += (a.kind == "F") - (a.kind == frees)
        peak = max(peak, now)
    return peak
