"""Modules as a lab writes them, for the user-model tests (`--model tests/engine/usermodels.py:unet`): a residual
CNN with GroupNorm, a U-Net whose long skip makes its middle cuts carry two tensors, a ViT with a class token, a
small causal language model, and constructs the graph capture must refuse."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, c)

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.blocks(F.relu(self.stem(x))).mean((2, 3)))


class UNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.down1 = nn.Conv2d(3, 8, 3, padding=1)
        self.down2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        a = F.relu(self.down1(x))
        b = F.relu(self.mid(F.relu(self.down2(a))))
        y = F.relu(self.out(torch.cat([a, self.up(b)], 1)))
        return self.head(y.mean((2, 3)))


class ViT(nn.Module):
    def __init__(self, classes=10, dim=32, patch=4, size=16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


class TinyLM(nn.Module):
    def __init__(self, vocab=300, dim=32, seq=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True, norm_first=True) for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x, src_mask=self.mask)
        return self.head(x)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: torch.fx cannot follow it
            return self.fc(x)
        return self.fc(-x)


def resnet():
    return ResNet()


def unet():
    return UNet()


def vit():
    return ViT()


def tiny_lm():
    return TinyLM()


def branchy():
    return Branchy()


def raises():
    raise RuntimeError("no GPU here")


def not_a_module():
    return 42


def tied_lm():
    """TinyLM with its output layer tied to its input embedding (GPT-2's way): one parameter, two names."""
    model = TinyLM()
    model.head.weight = model.embed.weight
    return model


class Gated(nn.Module):
    """A block fx cannot follow (it branches on a tensor's value) inside a chain of children."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x) if float(x.detach().abs().mean()) >= 0 else x


def branchy_chain():
    """Top-level children that form a chain, one of which fx cannot trace: cut at the children."""
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), Gated(32), nn.Linear(32, 10))


class NotAChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.b(self.a(x) + x)  # a skip past `a`: running the children in order is not the module
        return self.b(x)


def not_a_chain():
    return NotAChain()
