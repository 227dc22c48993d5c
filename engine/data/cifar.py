"""CIFAR-10 from the standard python-pickle batch files in a local folder (nothing is downloaded)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from engine.errors import UserError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
SUBFOLDER = "cifar-10-batches-py"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


class _ArrayUnpickler(pickle.Unpickler):
    """Loads dicts, lists, bytes and numpy arrays only: a batch file cannot run code."""

    ALLOWED = {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str) -> object:
        module = module.replace("numpy.core", "numpy._core")  # files pickled by numpy < 2
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def find_folder(root: str | Path, files: tuple[str, ...]) -> Path:
    """`root` or `root/cifar-10-batches-py`, whichever holds all `files`; UserError otherwise."""
    root = Path(root).expanduser()
    for folder in (root, root / SUBFOLDER):
        if all((folder / f).is_file() for f in files):
            return folder
    folder = root / SUBFOLDER if (root / SUBFOLDER).is_dir() else root
    missing = [f for f in files if not (folder / f).is_file()]
    raise UserError(
        f"CIFAR-10 not found in {folder}: missing {', '.join(missing)}; put the python-version batch "
        f"files (cifar-10-python.tar.gz, extracted) there or in {root / SUBFOLDER} — nothing is downloaded"
    )


def load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images N x 3 x 32 x 32, int64 labels N) from one batch file; UserError naming a corrupt file."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
            raise ValueError(f"data {data.shape} and labels {labels.shape} are not N x 3072 and N")
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise ValueError("labels outside 0..9")
    except Exception as exc:  # any failure to parse is the same user-facing problem
        raise UserError(f"corrupt CIFAR-10 file {path}: {type(exc).__name__}: {exc}") from None
    return data.reshape(-1, 3, 32, 32), labels


class CIFAR10(Dataset):
    """CIFAR-10 train (50,000) or test (10,000) images as normalized float32 3x32x32 and int64 labels."""

    def __init__(self, root: str | Path, train: bool = True) -> None:
        folder = find_folder(root, TRAIN_FILES if train else TEST_FILES)
        batches = [load_batch(folder / f) for f in (TRAIN_FILES if train else TEST_FILES)]
        self.images = np.concatenate([b[0] for b in batches])
        self.labels = torch.from_numpy(np.concatenate([b[1] for b in batches]))
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = torch.from_numpy(self.images[i]).float().div_(255)
        return (x - self.mean) / self.std, self.labels[i]
