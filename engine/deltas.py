"""Activation-change compression (AQ-SGD, NeurIPS'22): a sample seen before crosses a boundary as the quantised
change of its activation since it last crossed, which is far smaller than the activation itself.

    out = DeltaMemory(layer=12, cap=1797)         # the sender's side of the boundary before layer 12
    buf = out.encode("tx2-1", samples, x, 2)       # samples: the dataset indices of x's rows
    x_hat = inn.decode("nx-0", samples, buf, shape, 2)  # the receiver's side: the same rows the sender kept
    out.commit(k); inn.commit(k)                   # at the end of iteration k (the commit point)

Both ends of a pair (sender, receiver) keep, per sample, the activation they both reconstructed the last time
that sample crossed between them (in bfloat16: half of float32's bytes, the range of float32). A sample they
share crosses as `encode(x - kept, bits)` and both keep `kept + decode(...)`; a new one crosses as
`encode(x, bits)` (first sight at the boundary's level) and both keep what it decodes to. The rounding error
never accumulates: every change is taken against what the receiver really holds. Wire: the changed rows'
`engine.compression` message, then the new rows' (each left out when it has no rows); the receiver knows which
rows are which from its own copy, so nothing else is sent.

Bounded and exact: a pair keeps at most `cap` samples (the plan's `delta_samples`; the rest cross directly),
updates wait until the iteration commits (`commit`; a failed one is `discard`ed), and what each committed
iteration replaced is kept (at most `cap` entries a peer's worth) so that both ends can go back to the
iteration a recovery replays from (`roll_back`). At a generation change both ends of each pair say whether
they can (engine.runtime.deltalinks); a pair keeps its samples only when both can, so the two copies never
differ.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from engine.compression import decode, encode, wire_bytes

KEPT = torch.bfloat16  # what each kept activation is stored in


class DeltaMemory:
    """One device's side of one boundary: per (peer, sample), the activation both ends last reconstructed."""

    def __init__(self, layer: int, cap: int, live: int = 0) -> None:
        if cap < 1:
            raise ValueError(f"a delta memory needs room for >= 1 sample per peer, got {cap}")
        self.layer, self.cap = layer, cap  # the boundary (its first layer after it) and samples per peer
        self.live = live  # iterations committed into `kept`
        self.kept: dict[tuple[Hashable, int], torch.Tensor] = {}
        self.count: dict[Hashable, int] = {}  # samples kept per peer, staged ones included
        self.staged: dict[tuple[Hashable, int], torch.Tensor] = {}
        self.undo: list[tuple[int, dict]] = []  # (iteration, {key: what it replaced, None if new}), oldest first

    def seen(self, peer: Hashable, samples: Sequence[int]) -> list[bool]:
        return [(peer, int(s)) in self.kept for s in samples]

    def wire_bytes(self, peer: Hashable, samples: Sequence[int], shape: tuple[int, ...], bits: int) -> int:
        """Exact length of `encode(peer, samples, x, bits)` for rows of `shape`: what a receiver pre-allocates."""
        old = sum(self.seen(peer, samples))
        new = len(samples) - old
        return sum(wire_bytes((n, *shape), bits) for n in (old, new) if n)

    def encode(self, peer: Hashable, samples: Sequence[int], x: torch.Tensor, bits: int) -> torch.Tensor:
        """The rows of `x` (one per sample) as one flat uint8 tensor; stages what the receiver will hold."""
        x = x.detach().to(torch.float32)
        old, new, base = self._split(peer, samples, x.shape[1:])
        parts, out = [], torch.empty_like(x)
        if old:
            buf = encode(x[old] - base, bits)
            out[old] = base + decode(buf, (len(old), *x.shape[1:]), bits)
            parts.append(buf)
        if new:
            buf = encode(x[new], bits)
            out[new] = decode(buf, (len(new), *x.shape[1:]), bits)
            parts.append(buf)
        self._stage(peer, samples, out)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decode(
        self, peer: Hashable, samples: Sequence[int], buf: torch.Tensor, shape: tuple[int, ...], bits: int
    ) -> torch.Tensor:
        """The rows the sender's `encode` meant, as float32 of (len(samples), *shape); stages them."""
        old, new, base = self._split(peer, samples, shape)
        buf = buf.reshape(-1)
        if buf.numel() != self.wire_bytes(peer, samples, shape, bits):
            raise ValueError(f"{buf.numel()} bytes do not hold {len(samples)} rows of {shape} at {bits} bits")
        out = torch.empty((len(samples), *shape))
        at = 0
        if old:
            size = wire_bytes((len(old), *shape), bits)
            out[old] = base + decode(buf[at : at + size], (len(old), *shape), bits)
            at += size
        if new:
            out[new] = decode(buf[at:], (len(new), *shape), bits)
        self._stage(peer, samples, out)
        return out

    def _split(self, peer, samples, shape) -> tuple[list[int], list[int], torch.Tensor | None]:
        """Rows of samples this pair keeps, the other rows, and the kept activations of the first (float32)."""
        seen = self.seen(peer, samples)
        old = [i for i, s in enumerate(seen) if s]
        new = [i for i, s in enumerate(seen) if not s]
        base = None
        if old:
            base = torch.stack([self.kept[(peer, int(samples[i]))] for i in old]).to(torch.float32)
            if tuple(base.shape[1:]) != tuple(shape):
                raise ValueError(f"kept activations are {tuple(base.shape[1:])}, the boundary sends {tuple(shape)}")
        return old, new, base

    def _stage(self, peer: Hashable, samples: Sequence[int], rows: torch.Tensor) -> None:
        """What both ends keep once the iteration commits: every row of a kept sample, new ones while there is room."""
        for s, row in zip(samples, rows):
            key = (peer, int(s))
            if key not in self.kept and key not in self.staged:
                if self.count.get(peer, 0) >= self.cap:
                    continue  # full: this sample keeps crossing directly
                self.count[peer] = self.count.get(peer, 0) + 1
            self.staged[key] = row.to(KEPT)

    def commit(self, iteration: int) -> None:
        """Iteration `iteration` committed: what it staged is kept, and what that replaced can be put back."""
        if iteration != self.live:
            raise ValueError(f"delta memory at iteration {self.live} cannot commit iteration {iteration}")
        replaced = {key: self.kept.get(key) for key in self.staged}
        self.kept.update(self.staged)
        self.staged = {}
        self.undo.append((iteration, replaced))
        self.live = iteration + 1
        held = sum(len(r) for _, r in self.undo)
        while held > self.cap * max(1, len(self.count)):  # at most one peer-full of entries per peer
            held -= len(self.undo.pop(0)[1])

    def discard(self) -> None:
        """The iteration did not commit: forget what it staged."""
        for peer, _ in (k for k in self.staged if k not in self.kept):
            self.count[peer] -= 1
        self.staged = {}

    def can_roll_back(self, iteration: int) -> bool:
        """Whether the memory can be as it was when `iteration` iterations had committed."""
        return iteration == self.live or bool(self.undo) and self.undo[0][0] <= iteration < self.live

    def roll_back(self, iteration: int) -> None:
        """Back to `iteration` committed iterations (`can_roll_back` must hold)."""
        if not self.can_roll_back(iteration):
            raise ValueError(f"delta memory at iteration {self.live} cannot go back to {iteration}")
        self.discard()
        while self.live > iteration:
            k, replaced = self.undo.pop()
            for key, value in replaced.items():
                if value is None:
                    del self.kept[key]
                    self.count[key[0]] -= 1
                else:
                    self.kept[key] = value
            self.live = k

    def keep_only(self, peers: set) -> None:
        """Forget every sample kept with a peer not in `peers`, and what the memory could go back to."""
        self.discard()
        self.kept = {k: v for k, v in self.kept.items() if k[0] in peers}
        self.count = {p: n for p, n in self.count.items() if p in peers}
        self.undo = []

    @property
    def nbytes(self) -> int:
        entries = [*self.kept.values(), *(v for _, r in self.undo for v in r.values() if v is not None)]
        return sum(t.numel() * t.element_size() for t in entries)
