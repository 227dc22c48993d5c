"""Where every layer of a new generation comes from: the rollback point and the restore pieces (pure functions).

After a membership change the coordinator knows which copies of which layers exist: each survivor's live
layers (as of the iterations it committed), its snapshot of its own layers and its neighbour's replica (as of
the last replication point), the central replica, and the seed (any layer as of iteration 0, rebuilt from
the run's seed). The run rolls back to the newest iteration at which every layer has a copy, and each
device of the new plan gets each layer it now owns from, in order: itself, a live copy on another device,
a snapshot or replica on another device, the central replica, the seed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.plan import Plan

# Order of preference among copies of one layer at one iteration (lower first).
PREFERENCE = {"live": 0, "snapshot": 1, "replica": 2, "central": 3, "seed": 4}
SEED, CENTRAL = "seed", "central"


@dataclass(frozen=True)
class Copy:
    """Layers [start, end) as of `iteration` completed iterations, held by `holder` (a device, or the
    coordinator's central replica, or the seed)."""

    holder: str
    kind: str  # live, snapshot, replica, central, seed
    iteration: int
    start: int
    end: int

    def has(self, layer: int, iteration: int) -> bool:
        return self.iteration == iteration and self.start <= layer < self.end


@dataclass(frozen=True)
class Piece:
    """Device `to` gets layers [start, end) as of `iteration` from `source`'s copy of kind `kind`."""

    to: str
    start: int
    end: int
    source: str
    kind: str
    iteration: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> Piece:
        return cls(**doc)

    @property
    def local(self) -> bool:
        """Nothing crosses a link: the device holds the layers itself (or rebuilds them from the seed)."""
        return self.source in (self.to, SEED)


def seed_copy(num_layers: int) -> Copy:
    return Copy(SEED, SEED, 0, 0, num_layers)


def rollback_point(num_layers: int, copies: list[Copy]) -> int:
    """The newest iteration at which every layer has a copy (0 at worst: the seed holds every layer then)."""
    for t in sorted({c.iteration for c in copies} | {0}, reverse=True):
        if not missing(num_layers, copies, t):
            return t
    return 0


def missing(num_layers: int, copies: list[Copy], iteration: int) -> list[tuple[int, int]]:
    """Layer ranges [a, b) with no copy as of `iteration`."""
    out: list[tuple[int, int]] = []
    for layer in range(num_layers):
        if not any(c.has(layer, iteration) for c in copies):
            if out and out[-1][1] == layer:
                out[-1] = (out[-1][0], layer + 1)
            else:
                out.append((layer, layer + 1))
    return out


def restore_pieces(plan: Plan, iteration: int, copies: list[Copy]) -> list[Piece]:
    """For every device of `plan`, where each of its layers comes from as of `iteration` (every layer must
    have a copy then: see `rollback_point`). Consecutive layers from the same copy form one piece."""
    pieces: list[Piece] = []
    for stage in plan.stages:
        for share in stage.devices:
            current: Piece | None = None
            for layer in range(stage.start, stage.end):
                best = min(
                    (c for c in copies if c.has(layer, iteration)),
                    key=lambda c: (c.holder != share.name, PREFERENCE[c.kind], c.holder),
                )
                if current and (current.source, current.kind) == (best.holder, best.kind):
                    current = Piece(share.name, current.start, layer + 1, best.holder, best.kind, iteration)
                else:
                    if current:
                        pieces.append(current)
                    current = Piece(share.name, layer, layer + 1, best.holder, best.kind, iteration)
            if current:
                pieces.append(current)
    return pieces


def neighbour(plan: Plan, stage: int) -> str | None:
    """The device that keeps a replica of `stage`'s layers: the first device of the next stage, wrapping
    around; None for a one-stage plan (its data-parallel devices already hold each other's layers)."""
    if len(plan.stages) < 2:
        return None
    return plan.stages[(stage + 1) % len(plan.stages)].devices[0].name


def layer_text(start: int, end: int) -> str:
    """Layers [start, end) as people read them: "layer 6" or "layers 6-11" (inclusive)."""
    return f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
