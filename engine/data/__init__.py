"""Datasets: CIFAR-10 read from local pickle batches, and seeded synthetic vision and text data."""

from engine.data.cifar import CIFAR10
from engine.data.registry import dataset_names, get_dataset
from engine.data.synthetic import SyntheticText, SyntheticVision

__all__ = ["CIFAR10", "SyntheticText", "SyntheticVision", "dataset_names", "get_dataset"]
