"""MobileNetV2 as 21 layers: stem, 17 inverted-residual blocks, last 1x1 conv, pool, classifier."""

from __future__ import annotations

from torch import Tensor, nn

from engine.models.randomness import Dropout
from engine.models.spec import ModelSpec

# (expansion t, output channels c, repeats n, first stride s) from the MobileNetV2 paper.
CONFIG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    mods = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act:
        mods.append(nn.ReLU6())
    return nn.Sequential(*mods)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1); a skip connection when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        mods = [conv_bn(cin, hidden, 1)] if expand != 1 else []
        mods += [conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, cout, 1, act=False)]
        self.conv = nn.Sequential(*mods)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenetv2_layers(num_classes: int, cifar: bool) -> list[nn.Module]:
    # CIFAR variant: stride-1 stem and stride-1 second stage, so 32x32 ends at 4x4 instead of 1x1.
    layers: list[nn.Module] = [conv_bn(3, 32, 3, stride=1 if cifar else 2)]
    cin = 32
    for i, (t, c, n, s) in enumerate(CONFIG):
        if cifar and i == 1:
            s = 1
        for j in range(n):
            layers.append(InvertedResidual(cin, c, s if j == 0 else 1, t))
            cin = c
    layers.append(conv_bn(cin, 1280, 1))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
    layers.append(nn.Sequential(Dropout(0.2), nn.Linear(1280, num_classes)))
    return layers


def specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            "mobilenetv2",
            "cnn",
            "classification",
            (3, 32, 32),
            "float32",
            10,
            "MobileNetV2 for CIFAR-10 (stride-1 stem and second stage)",
            lambda: mobilenetv2_layers(10, True),
        ),
        ModelSpec(
            "mobilenetv2-224",
            "cnn",
            "classification",
            (3, 224, 224),
            "float32",
            1000,
            "MobileNetV2 for ImageNet (224x224, 1000 classes)",
            lambda: mobilenetv2_layers(1000, False),
        ),
    ]
