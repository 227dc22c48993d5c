"""ResNet-50 as 20 (CIFAR) or 21 (ImageNet) layers: split stem, 16 bottleneck blocks, pool, fc."""

from __future__ import annotations

from torch import Tensor, nn

from engine.models.spec import ModelSpec

# (bottleneck width, blocks, first stride) of the four ResNet-50 stages.
STAGES = [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]
EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand, plus the (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet50_layers(num_classes: int, cifar: bool) -> list[nn.Module]:
    if cifar:
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Sequential(nn.BatchNorm2d(64), nn.ReLU())]
    else:
        layers = [
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.Sequential(nn.BatchNorm2d(64), nn.ReLU()),
            nn.MaxPool2d(3, 2, 1),
        ]
    cin = 64
    for width, blocks, stride in STAGES:
        for j in range(blocks):
            layers.append(Bottleneck(cin, width, stride if j == 0 else 1))
            cin = width * EXPANSION
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
    layers.append(nn.Linear(cin, num_classes))
    return layers


def specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            "resnet50",
            "cnn",
            "classification",
            (3, 32, 32),
            "float32",
            10,
            "ResNet-50 for CIFAR-10 (3x3 stride-1 stem, no max-pool)",
            lambda: resnet50_layers(10, True),
        ),
        ModelSpec(
            "resnet50-224",
            "cnn",
            "classification",
            (3, 224, 224),
            "float32",
            1000,
            "ResNet-50 for ImageNet (224x224, 1000 classes)",
            lambda: resnet50_layers(1000, False),
        ),
    ]
