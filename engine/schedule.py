"""The 1F1B schedule as plain data: per stage, an ordered list of (stage, kind, micro-batch) actions.

With S stages and M micro-batches, stage s first runs min(S - s - 1, M) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. For S=3, M=4:

    stage 0:  F0 F1 F2    B0 F3 B1    B2 B3
    stage 1:  F0 F1    B0 F2 B1 F3 B2 B3
    stage 2:  F0 B0 F1 B1 F2 B2 F3 B3

Every device of a stage runs its stage's list on its own share of each micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    """One step of a stage: "F" (forward) or "B" (backward) of a micro-batch; string form "2F0"."""

    stage: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        for kind in ("F", "B"):
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


def in_flight(num_stages: int, micro_batches: int, stage: int) -> int:
    """Most micro-batches whose activations stage `stage` holds at once under 1F1B."""
    return min(num_stages - stage, micro_batches)
