"""The real 8x8 handwritten digits bundled with scikit-learn (offline), upscaled to an image model's input size."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

N = 1797  # images in scikit-learn's digits set
TEST = N // 5  # held out: the first fifth of a fixed permutation
SPLIT_SEED = 8  # fixed, so the split never depends on a run's seed


class Digits(Dataset):
    """Train (1438) or test (359) digits as float32 `shape` images (bilinear upscaling, the grey channel
    repeated, normalised by the whole set's mean and std) with int64 labels 0..9."""

    def __init__(self, shape: tuple[int, int, int], train: bool = True) -> None:
        from sklearn.datasets import load_digits  # lazy: importing scikit-learn takes a second

        images, labels = load_digits(return_X_y=True)
        x = torch.from_numpy(images).float().view(-1, 1, 8, 8)
        x = (x - x.mean()) / x.std()
        order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(x)))
        keep = order[TEST:] if train else order[:TEST]
        self.images, self.labels = x[keep], torch.from_numpy(labels)[keep]
        self.shape = shape

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = F.interpolate(self.images[i][None], size=self.shape[1:], mode="bilinear", align_corners=False)[0]
        return x.repeat(self.shape[0], 1, 1), self.labels[i]
