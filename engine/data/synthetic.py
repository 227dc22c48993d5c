"""Synthetic, learnable, seeded datasets: class-prototype images and Markov-chain token sequences.

`seed` fixes the task (prototypes, chain, label rule); `train` picks one of two disjoint sample streams.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from engine.errors import UserError


class SyntheticVision(Dataset):
    """Images = a blocky per-class prototype (a 4x4 colour pattern scaled up) plus Gaussian noise.

    Labels are learnable by any CNN. Each image is a function of (seed, split, index) and only
    the small prototypes are kept in memory, so 224x224 sets of any size are cheap.
    """

    def __init__(
        self, n: int, shape: tuple[int, ...], num_classes: int, seed: int = 0, train: bool = True, noise: float = 1.0
    ) -> None:
        if n < 1 or num_classes < 2 or not shape:
            raise UserError(
                f"synthetic vision data needs n >= 1, num_classes >= 2 and a shape; got {n}, {num_classes}, {shape}"
            )
        self.n, self.shape, self.noise = n, tuple(shape), noise
        task = torch.Generator().manual_seed(seed)
        low_res = (self.shape[0], 4, 4) if len(self.shape) == 3 else self.shape
        self.prototypes = torch.randn(num_classes, *low_res, generator=task)
        self.stream = 2 * seed + (0 if train else 1)
        samples = torch.Generator().manual_seed(self.stream)
        self.labels = torch.randint(num_classes, (n,), generator=samples)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        y = self.labels[i]
        proto = self.prototypes[y]
        if len(self.shape) == 3:
            proto = F.interpolate(proto[None], size=self.shape[1:], mode="nearest")[0]
        g = torch.Generator().manual_seed(self.stream * 1_000_003 + i + 1)
        return proto + self.noise * torch.randn(self.shape, generator=g), y


class SyntheticText(Dataset):
    """Token sequences from a seeded sparse Markov chain (each token has a few likely successors).

    "language-modeling": (tokens[:-1], tokens[1:]); next tokens are predictable from the chain.
    "classification": (tokens, label); the label bins how many tokens fall in the lower half of the
    vocabulary, with bin edges at quantiles of reference sequences, so classes are about balanced.
    """

    SUCCESSORS = 4
    REFERENCE = 1024

    def __init__(
        self,
        n: int,
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        task: str = "language-modeling",
        num_classes: int = 2,
        train: bool = True,
    ) -> None:
        if task not in ("language-modeling", "classification"):
            raise UserError(f"unknown text task {task!r}; use 'language-modeling' or 'classification'")
        if n < 1 or seq_len < 1 or vocab_size < 2 or num_classes < 2:
            raise UserError(
                f"synthetic text needs n, seq_len >= 1 and vocab_size, num_classes >= 2; "
                f"got {n}, {seq_len}, {vocab_size}, {num_classes}"
            )
        self.task, self.vocab_size = task, vocab_size
        rng = np.random.default_rng([seed, 0])
        k = min(self.SUCCESSORS, vocab_size)
        self.successors = np.stack([rng.choice(vocab_size, k, replace=False) for _ in range(vocab_size)])
        self.cumulative = np.cumsum(rng.dirichlet(np.ones(k), size=vocab_size), axis=1)
        tokens = self._walk(np.random.default_rng([seed, 1 if train else 2]), n, seq_len)
        self.tokens = torch.from_numpy(tokens)
        if task == "classification":
            reference = self._walk(rng, self.REFERENCE, seq_len)
            self.cuts = np.quantile(self._low(reference), np.arange(1, num_classes) / num_classes)
            self.labels = torch.from_numpy(np.searchsorted(self.cuts, self._low(tokens), side="right").astype(np.int64))

    def _walk(self, rng: np.random.Generator, n: int, seq_len: int) -> np.ndarray:
        """n chains of seq_len + 1 tokens."""
        tokens = np.empty((n, seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(self.vocab_size, size=n)
        for t in range(seq_len):
            u = rng.random((n, 1))
            choice = np.minimum((u > self.cumulative[tokens[:, t]]).sum(1), self.successors.shape[1] - 1)
            tokens[:, t + 1] = self.successors[tokens[:, t], choice]
        return tokens

    def _low(self, tokens: np.ndarray) -> np.ndarray:
        return (tokens[:, :-1] < self.vocab_size // 2).sum(1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        seq = self.tokens[i]
        if self.task == "language-modeling":
            return seq[:-1], seq[1:]
        return seq[:-1], self.labels[i]
