"""Datasets by name for a model: CIFAR-10 from disk, or synthetic data shaped for the model."""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

from engine.data.cifar import CIFAR10
from engine.data.synthetic import SyntheticText, SyntheticVision
from engine.errors import UserError
from engine.models import ModelSpec

DATASETS = ("cifar10", "synthetic")


def dataset_names() -> list[str]:
    return list(DATASETS)


def default_data_dir() -> Path:
    """`$ASTEROID_DATA_DIR`, else ~/.cache/asteroid/data."""
    env = os.environ.get("ASTEROID_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asteroid" / "data"


def get_dataset(
    name: str, spec: ModelSpec, root: str | Path | None = None, size: int = 2048, seed: int = 0, train: bool = True
) -> Dataset:
    """The dataset `name` for `spec`. `size` and `seed` shape synthetic data; CIFAR-10 is always the full split."""
    if name == "cifar10":
        if spec.input_shape != (3, 32, 32) or spec.num_classes != 10:
            raise UserError(
                f"dataset 'cifar10' needs a 3x32x32 model with 10 classes; {spec.name!r} takes "
                f"{spec.input_shape} with {spec.num_classes} classes: use a 32x32 model "
                f"(e.g. mobilenetv2) or dataset 'synthetic'"
            )
        return CIFAR10(root if root is not None else default_data_dir(), train=train)
    if name == "synthetic":
        if spec.input_dtype == "int64":
            return SyntheticText(size, spec.input_shape[0], spec.vocab_size, seed, spec.task, spec.num_classes, train)
        return SyntheticVision(size, spec.input_shape, spec.num_classes, seed, train)
    raise UserError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
