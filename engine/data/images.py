"""Your own images for classification: a folder with one sub-folder per class of PNG/JPEG files, read with Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from engine.data.fit import image_models, require_image_model
from engine.errors import UserError
from engine.models import ModelSpec

EXTENSIONS = (".png", ".jpg", ".jpeg")
TEST_EVERY = 5  # the 5th, 10th, ... image of each class (in name order) is held out
MEAN = (0.485, 0.456, 0.406)  # ImageNet's statistics: the usual normalisation for photos
STD = (0.229, 0.224, 0.225)


def class_files(root: str | Path | None, spec: ModelSpec) -> list[list[Path]]:
    """Each class's image files, classes in sorted folder-name order; UserError for a folder that cannot be used."""
    require_image_model("images", spec, 2)
    if root is None:
        raise UserError("dataset 'images' needs a folder: give --data-dir DIR with one sub-folder of images per class")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"image folder {root} not found" + (" (it is a file)" if root.exists() else ""))
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    classes = [sorted(f for f in d.iterdir() if f.is_file() and f.suffix.lower() in EXTENSIONS) for d in folders]
    if not any(classes):
        raise UserError(f"image folder {root} has no images: put PNG/JPEG files in one sub-folder per class")
    empty = [d.name for d, files in zip(folders, classes) if not files]
    if empty:
        raise UserError(f"class folder(s) {', '.join(empty)} in {root} hold no PNG/JPEG images: fill or remove them")
    if len(classes) == 1:
        raise UserError(f"image folder {root} has one class ({folders[0].name}): give at least 2 class sub-folders")
    if len(classes) > spec.num_classes:
        fits = image_models(len(classes))
        raise UserError(
            f"image folder {root} has {len(classes)} classes but {spec.name!r} has {spec.num_classes} outputs: "
            + (f"use {', '.join(fits)}" if fits else "no model in the zoo has that many")
        )
    return classes


def split(classes: list[list[Path]], train: bool = True) -> list[tuple[Path, int]]:
    """(file, class index) of the training or held-out images."""
    return [
        (f, c)
        for c, files in enumerate(classes)
        for k, f in enumerate(files)
        if (k % TEST_EVERY == TEST_EVERY - 1) != train
    ]


def read_image(path: Path, height: int, width: int) -> Tensor:
    """uint8 3 x height x width (RGB, resized bilinearly); UserError naming a file Pillow cannot read."""
    from PIL import Image  # lazy: only this dataset needs Pillow

    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    except Exception as exc:  # any failure to decode is the same user-facing problem
        raise UserError(f"unreadable image {path}: {type(exc).__name__}: {exc}") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


class ImageFolder(Dataset):
    """A split of the folder's images, decoded once and kept as uint8 at the model's input size; items are
    normalised float32 images and int64 class indices."""

    def __init__(self, root: str | Path | None, spec: ModelSpec, train: bool = True) -> None:
        samples = split(class_files(root, spec), train)
        if not samples:
            raise UserError(
                f"image folder {root} has no held-out images: every {TEST_EVERY}th image of a class is held out, "
                f"so give some class at least {TEST_EVERY}"
            )
        _, height, width = spec.input_shape
        self.images = torch.stack([read_image(path, height, width) for path, _ in samples])
        self.labels = torch.tensor([label for _, label in samples])
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return (self.images[i].float().div_(255) - self.mean) / self.std, self.labels[i]


def train_size(root: str | Path | None, spec: ModelSpec) -> int:
    """Training images in the folder, counted without decoding them."""
    return len(split(class_files(root, spec)))
