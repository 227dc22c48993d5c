"""A lab's own models, as it would write them: what `--model examples/lab_models.py:FUNCTION` trains.

    python -m engine plan  --model examples/lab_models.py:resnet18_gn --input-shape 3,32,32 --cluster C --batch-size 64
    python -m engine train --model examples/lab_models.py:resnet18_gn --input-shape 3,32,32 --cluster C --emulate \
        --dataset cifar10 --data-dir data/cifar-10-batches-py --save resnet.safetensors

Each function takes no arguments and returns an nn.Module; Asteroid captures its graph and cuts it (its long skips
and residuals travel across the cuts), and `--save` writes weights that `resnet18_gn().load_state_dict(...)` reads.
"""

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """ResNet's basic block with GroupNorm (BatchNorm over a micro-batch is not BatchNorm over the batch)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    def __init__(self, classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(8, width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class SmallUNet(nn.Module):
    """An encoder-decoder whose long skips make the cuts inside them carry two or three tensors; classifies."""

    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(8, width), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, 2, 1), nn.GroupNorm(8, 2 * width), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, 2, 1), nn.GroupNorm(8, 2 * width), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(2 * width, 2 * width, 2, 2)
        self.dec2 = nn.Sequential(nn.Conv2d(4 * width, width, 3, padding=1), nn.GroupNorm(8, width), nn.ReLU())
        self.up1 = nn.ConvTranspose2d(width, width, 2, 2)
        self.dec1 = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.GroupNorm(8, width), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        a = self.enc1(x)
        b = self.enc2(a)
        y = self.dec2(torch.cat([b, self.up2(self.mid(b))], 1))
        y = self.dec1(torch.cat([a, self.up1(y)], 1))
        return self.head(y.mean((2, 3)))


def resnet18_gn():
    return ResNet18GN()


def small_unet():
    return SmallUNet()
