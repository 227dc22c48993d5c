"""VGG-16 without BatchNorm; every conv, ReLU, max-pool and classifier op is its own layer."""

from __future__ import annotations

from torch import nn

from engine.models.randomness import Dropout
from engine.models.spec import ModelSpec

# Configuration "D" of the VGG paper: output channels, "M" for a 2x2 max-pool.
CONFIG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16_layers(num_classes: int, cifar: bool) -> list[nn.Module]:
    # No in-place ReLU: a layer must never modify the tensor another layer (or the profiler) handed it.
    layers: list[nn.Module] = []
    cin = 3
    for v in CONFIG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
            cin = v
    layers.append(nn.Flatten())
    # 32x32 inputs end at 512x1x1; 224x224 inputs at 512x7x7 = 25088 features.
    features, hidden = (512, 512) if cifar else (512 * 7 * 7, 4096)
    layers += [
        nn.Linear(features, hidden),
        nn.ReLU(),
        Dropout(0.5),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        Dropout(0.5),
        nn.Linear(hidden, num_classes),
    ]
    return layers


def specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            "vgg16",
            "cnn",
            "classification",
            (3, 32, 32),
            "float32",
            10,
            "VGG-16 (no BatchNorm) for CIFAR-10, 512-512-10 classifier",
            lambda: vgg16_layers(10, True),
        ),
        ModelSpec(
            "vgg16-224",
            "cnn",
            "classification",
            (3, 224, 224),
            "float32",
            1000,
            "VGG-16 (no BatchNorm) for ImageNet, 25088-4096-4096-1000 classifier",
            lambda: vgg16_layers(1000, False),
        ),
    ]
