"""Execution configurations of one host that behave as distinct devices: threads, number format, memory layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.errors import UserError


@dataclass(frozen=True)
class Config:
    """How layers run: `threads` CPU threads, parameters and activations in `dtype`, convolution inputs in
    channels-last layout or not, on `device` ("cpu" or "cuda")."""

    name: str
    threads: int = 1
    dtype: str = "float32"
    channels_last: bool = False
    device: str = "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def layer(self, layer: nn.Module) -> nn.Module:
        """`layer` moved to this configuration's device, number format and layout."""
        layer = layer.to(device=self.device, dtype=self.torch_dtype)
        return layer.to(memory_format=torch.channels_last) if self.channels_last else layer

    def tensor(self, x: Tensor) -> Tensor:
        """An input moved likewise (token ids keep their integer type)."""
        x = x.to(self.device)
        if x.is_floating_point():
            x = x.to(self.torch_dtype)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
        return x

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run with this configuration's thread count, restoring the caller's."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


# Six genuinely different per-layer behaviours of one CPU: bfloat16 speeds matmuls (on CPUs with bf16 units) but
# not normalisation or pooling; channels-last changes which convolution kernels run; a second thread helps big
# layers and barely helps small ones. A lent GPU adds a seventh ("cuda").
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("fp32-1t"),
        Config("fp32-2t", threads=2),
        Config("bf16-1t", dtype="bfloat16"),
        Config("bf16-2t", threads=2, dtype="bfloat16"),
        Config("cl-1t", channels_last=True),
        Config("cl-2t", threads=2, channels_last=True),
        Config("cuda", device="cuda"),
    )
}


def get_config(name: str) -> Config:
    """A configuration by name; a UserError lists the known ones."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise UserError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}") from None


def available() -> list[str]:
    """The configurations this machine can run (cuda only with a GPU)."""
    return [n for n, c in CONFIGS.items() if c.device == "cpu" or torch.cuda.is_available()]
