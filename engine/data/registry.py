"""Datasets by name for a model: bundled real data, the user's own files, CIFAR-10 from disk, or synthetic data."""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

from engine.data import digits, images, text
from engine.data.cifar import CIFAR10
from engine.data.fit import require_byte_language_model, require_image_model
from engine.data.synthetic import SyntheticText, SyntheticVision
from engine.errors import UserError
from engine.models import ModelSpec

DATASETS = ("cifar10", "digits", "images", "pytext", "synthetic", "text")
PATH_DATASETS = ("images", "text")  # read from --data-dir only (the user's own files)
CIFAR10_TRAIN = 50_000


def dataset_names() -> list[str]:
    return list(DATASETS)


def default_data_dir() -> Path:
    """`$ASTEROID_DATA_DIR`, else ~/.cache/asteroid/data."""
    env = os.environ.get("ASTEROID_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asteroid" / "data"


def datasets_here(root: str | Path | None = None) -> list[str]:
    """The named datasets this host can serve (what a board's agent reports): the bundled ones and synthetic
    always, CIFAR-10 when its files are in `root` (default `default_data_dir()`). The path datasets are a
    CLI user's own files, named per run: not among them."""
    from engine.data.cifar import TEST_FILES, TRAIN_FILES, find_folder

    here = []
    for name in DATASETS:
        if name == "cifar10":
            try:
                find_folder(root if root is not None else default_data_dir(), TRAIN_FILES + TEST_FILES)
            except UserError:
                continue
        if name not in PATH_DATASETS:
            here.append(name)
    return here


def check_cifar10(spec: ModelSpec) -> None:
    if spec.input_shape != (3, 32, 32) or spec.num_classes != 10:
        raise UserError(
            f"cifar10 needs a 32x32 image model with 10 classes; {spec.name!r} takes "
            f"{spec.input_shape} with {spec.num_classes} classes: use a 32x32 model "
            f"(e.g. mobilenetv2) or dataset 'synthetic'"
        )


def get_dataset(
    name: str, spec: ModelSpec, root: str | Path | None = None, size: int = 2048, seed: int = 0, train: bool = True
) -> Dataset:
    """The dataset `name` for `spec`. `size` and `seed` shape synthetic data; the others have fixed splits.

    `root`: CIFAR-10's folder (default `default_data_dir()`), the images' folder or the text file.
    """
    if name == "cifar10":
        check_cifar10(spec)
        return CIFAR10(root if root is not None else default_data_dir(), train=train)
    if name == "digits":
        require_image_model(name, spec, 10)
        return digits.Digits(spec.input_shape, train)
    if name == "pytext":
        require_byte_language_model(name, spec)
        return text.pytext(spec.input_shape[0], train, spec.tokenizer)
    if name == "images":
        return images.ImageFolder(root, spec, train)
    if name == "text":
        require_byte_language_model(name, spec)
        return text.text_file(root, spec.input_shape[0], train, spec.tokenizer)
    if name == "synthetic":
        if spec.input_dtype == "int64":
            return SyntheticText(size, spec.input_shape[0], spec.vocab_size, seed, spec.task, spec.num_classes, train)
        return SyntheticVision(size, spec.input_shape, spec.num_classes, seed, train)
    raise UserError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")


def train_size(name: str, spec: ModelSpec, root: str | Path | None = None, size: int = 2048) -> int:
    """Samples in one epoch of `get_dataset(name, spec, root, size)`, checked the same way but without
    reading the data (only file sizes and names)."""
    if name == "cifar10":
        check_cifar10(spec)
        return CIFAR10_TRAIN
    if name == "digits":
        require_image_model(name, spec, 10)
        return digits.N - digits.TEST
    if name == "pytext":
        require_byte_language_model(name, spec)
        return text.pytext_train_size(spec.input_shape[0], spec.tokenizer)
    if name == "images":
        return images.train_size(root, spec)
    if name == "text":
        require_byte_language_model(name, spec)
        return text.text_file_train_size(root, spec.input_shape[0], spec.tokenizer)
    if name == "synthetic":
        return size
    raise UserError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
