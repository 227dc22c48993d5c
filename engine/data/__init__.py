"""Datasets: bundled real digits and Python source, the user's image folders and text files, CIFAR-10, synthetic."""

from engine.data.cifar import CIFAR10
from engine.data.digits import Digits
from engine.data.images import ImageFolder
from engine.data.registry import PATH_DATASETS, dataset_names, datasets_here, get_dataset, train_size
from engine.data.synthetic import SyntheticText, SyntheticVision
from engine.data.text import ByteWindows

__all__ = [
    "CIFAR10",
    "ByteWindows",
    "Digits",
    "ImageFolder",
    "PATH_DATASETS",
    "SyntheticText",
    "SyntheticVision",
    "dataset_names",
    "datasets_here",
    "get_dataset",
    "train_size",
]
