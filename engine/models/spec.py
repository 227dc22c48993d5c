"""Model specification: an ordered list of partitionable layers plus the input it expects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.randomness import number_draws

FAMILIES = ("cnn", "transformer")
TASKS = ("classification", "language-modeling")
DTYPES = {"float32": torch.float32, "int64": torch.int64}


def layer_name(index: int, layer: nn.Module) -> str:
    """A readable layer label: "3:InvertedResidual", or "0:Conv2d+BatchNorm2d+ReLU6" for a plain Sequential (a
    layer cut from a user's graph carries its own, "3:layer2.0+layer2.1")."""
    if isinstance(getattr(layer, "label", None), str):
        return layer.label
    if type(layer) is nn.Sequential:
        return f"{index}:" + "+".join(type(m).__name__ for m in layer)
    return f"{index}:{type(layer).__name__}"


@dataclass(frozen=True)
class ModelSpec:
    """A model as pipeline stages see it: layers that each map one tensor to one tensor.

    `num_classes` is the vocabulary size for language modeling; `vocab_size` is the token
    vocabulary of text models (0 for vision models).
    """

    name: str
    family: str
    task: str
    input_shape: tuple[int, ...]
    input_dtype: str
    num_classes: int
    description: str
    factory: Callable[[], list[nn.Module]]
    vocab_size: int = 0
    chain: Any = None  # a user's module (engine.models.graph.Chain): its cuts; None for the zoo's hand-cut layers
    digest: str = ""  # a user's module: the SHA-256 of its file (or folder)
    build: Any = None  # a user's module: the function that builds it whole (its own class, its own keys)
    tokenizer: str = ""  # a Hugging Face folder with a tokenizer: text datasets are its token ids, not bytes

    def compressible(self, boundary: int) -> bool:
        """Whether what crosses the cut before layer `boundary` may be compressed (not when it holds integers)."""
        return self.chain is None or not self.chain.exact(boundary)

    @property
    def cache_name(self) -> str:
        """The name of its profile in the cache: a user's module by its file's hash and its input."""
        if not self.digest:
            return self.name
        return f"user-{self.digest[:16]}-{'x'.join(map(str, self.input_shape))}-{self.input_dtype}"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family {self.family!r} not in {FAMILIES}")
        if self.task not in TASKS:
            raise ValueError(f"{self.name}: task {self.task!r} not in {TASKS}")
        if self.input_dtype not in DTYPES:
            raise ValueError(f"{self.name}: input_dtype {self.input_dtype!r} not in {tuple(DTYPES)}")
        if self.input_dtype == "int64" and self.vocab_size <= 0:
            raise ValueError(f"{self.name}: token inputs need a positive vocab_size")

    def layers(self) -> list[nn.Module]:
        """Fresh layers, initialised from torch's global RNG (deterministic under torch.manual_seed).

        Their Dropouts are keyed by layer index (see randomness.number_draws), whatever the stages later.
        """
        layers = list(self.factory())
        number_draws(layers)
        return layers

    def sequential(self) -> nn.Sequential:
        """The unpartitioned model made of fresh layers."""
        return nn.Sequential(*self.layers())

    def example_batch(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """A random batch (x, y) of `n` samples shaped and typed like real data."""
        if self.input_dtype == "int64":
            if self.task == "language-modeling":
                # Targets are the next tokens of the same sequence.
                tokens = torch.randint(self.vocab_size, (n, self.input_shape[0] + 1), generator=generator)
                return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            x = torch.randint(self.vocab_size, (n, *self.input_shape), generator=generator)
        else:
            x = torch.randn((n, *self.input_shape), generator=generator)
        y = torch.randint(self.num_classes, (n,), generator=generator)
        return x, y

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy; for language modeling the mean is over all tokens."""
        if self.task == "language-modeling":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.input_dtype]
