"""Which samples make up each global batch, and loading them: the same on every device and in a reference run."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from engine.errors import UserError


def batch_indices(n: int, batch_size: int, seed: int, iteration: int) -> Tensor:
    """Dataset indices of global batch `iteration`: a fresh shuffle per epoch, the incomplete tail dropped."""
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise ValueError(f"a dataset of {n} samples holds no batch of {batch_size}")
    epoch, k = divmod(iteration, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[k * batch_size : (k + 1) * batch_size]


def load(dataset: Dataset, indices: Tensor) -> tuple[Tensor, Tensor]:
    """Stack the samples at `indices` into (inputs, targets)."""
    items = [dataset[int(i)] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


def eval_batches(n: int, batch_size: int, most: int) -> int:
    """Whole global batches of the held-out split an evaluation scores: its first min(n, most) samples, in order."""
    count = min(n, most) // batch_size
    if count < 1:
        raise UserError(
            f"the held-out split has {n} samples and at most {most} are scored: that holds no batch of {batch_size}; "
            "lower --batch-size or raise --eval-samples"
        )
    return count
