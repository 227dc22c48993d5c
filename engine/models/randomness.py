"""Dropout whose masks depend on (seed, iteration, sample position, layer), never on the process drawing them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MASK64 = (1 << 64) - 1
MASK63 = (1 << 63) - 1
DOMAIN = 0x6173_7465_726F_6964  # "asteroid": keeps these seeds apart from other uses of the same integers


def splitmix64(z: int) -> int:
    """The SplitMix64 finaliser: a bijective, well-mixing 64-bit hash."""
    z = (z + 0x9E37_79B9_7F4A_7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & MASK64
    return z ^ (z >> 31)


def mix(*values: int) -> int:
    """A 63-bit seed that is a deterministic function of the integers (order matters; same in every process)."""
    h = DOMAIN
    for v in values:
        h = splitmix64(h ^ (v & MASK64))
    return h & MASK63


@dataclass(frozen=True)
class Draws:
    """An active draw context: the rows a Dropout sees are samples `positions` of batch `iteration`."""

    seed: int
    iteration: int
    positions: range


class _Contexts(threading.local):
    def __init__(self) -> None:
        self.stack: list[Draws] = []


_contexts = _Contexts()


def active_draws() -> Draws | None:
    """The innermost active `sample_draws` context of this thread, if any."""
    return _contexts.stack[-1] if _contexts.stack else None


@contextmanager
def sample_draws(seed: int, iteration: int, positions: range) -> Iterator[None]:
    """While active, row i of every Dropout input is sample positions[i] of global batch `iteration`."""
    _contexts.stack.append(Draws(seed, iteration, positions))
    try:
        yield
    finally:
        _contexts.stack.pop()


class Dropout(nn.Module):
    """nn.Dropout whose per-sample masks, inside `sample_draws`, are a function of the sample, not the process."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.key: tuple[int, int] | None = None  # set by number_draws

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key}"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        draws = active_draws()
        if draws is None:
            return F.dropout(x, self.p, training=True)
        key = self.key
        if key is None:
            raise RuntimeError("Dropout has no key inside sample_draws: call number_draws on the model's layers")
        rows = x.shape[0] if x.ndim else None
        if rows != len(draws.positions):
            raise ValueError(
                f"sample_draws covers {len(draws.positions)} samples ({draws.positions}) "
                f"but Dropout got a tensor of shape {tuple(x.shape)} (dim 0 = samples)"
            )
        if self.p == 1.0:
            return x * 0.0
        return x * self.noise(draws, key, x)

    def noise(self, draws: Draws, key: tuple[int, int], x: Tensor) -> Tensor:
        """Kept-and-rescaled mask shaped like x: row i drawn from its own generator, on the CPU for every device."""
        per_row = x[0].numel() if x.shape[0] else 0
        uniform = torch.empty((x.shape[0], per_row), dtype=torch.float32)
        g = torch.Generator()
        layer, j = key
        for i, position in enumerate(draws.positions):
            g.manual_seed(mix(draws.seed, draws.iteration, position, layer, j))
            torch.rand(per_row, generator=g, out=uniform[i])
        keep = (uniform >= self.p).to(x.dtype).div_(1.0 - self.p)
        return keep.view(x.shape).to(x.device)


def number_draws(layers: list[nn.Module]) -> None:
    """Key every Dropout inside `layers` as (layer index, its rank among that layer's Dropouts in modules() order)."""
    for index, layer in enumerate(layers):
        for j, m in enumerate(m for m in layer.modules() if isinstance(m, Dropout)):
            m.key = (index, j)
