"""Low-rank adapters (LoRA): a Linear layer's frozen weight W plus a trained product B A of rank r, merged into W
when the model is saved, so the saved model is the plain module.

    wrapped = add_adapters(spec, layers, rank=8, pattern="qkv|proj")   # the Linear layers it wrapped, by name
    state = merged(state)                                               # W + B A under W's key; no adapter keys

The adapted layer keeps W and its bias under their own names (`f.qkv.weight`), beside `lora_a` (r x in, Kaiming
uniform as PEFT initialises it) and `lora_b` (out x r, zeros: the adapted model starts as the base model). The
scale alpha / r is 1 (alpha = r). Only `torch.nn.Linear` layers are adapted (not convolutions, nor transformers'
GPT-2 `Conv1D`).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.models.spec import ModelSpec

ADAPTER = (".lora_a", ".lora_b")


class LoRALinear(nn.Linear):
    """A Linear layer whose weight and bias are the wrapped layer's (frozen), plus a trained low-rank update."""

    def __init__(self, base: nn.Linear, rank: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        if self.lora_a.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER)


def add_adapters(spec: ModelSpec, layers: list[nn.Module], rank: int, pattern: str = "") -> list[str]:
    """Wrap every Linear layer whose name (as the model names it; a zoo model's `3.f.qkv`) `pattern` finds (all
    of them when empty) in a LoRALinear of `rank`; returns their names. None found is an error."""
    if rank <= 0:
        return []
    regex = re.compile(pattern) if pattern else None
    wrapped = []
    for i, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            full = name if spec.chain is not None else f"{i}.{name}"
            if type(module) is not nn.Linear or not name or (regex is not None and not regex.search(full)):
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, attr, LoRALinear(module, rank))
            wrapped.append(full)
    if not wrapped:
        what = f"no Linear layer's name matches {pattern!r}" if pattern else "it has no Linear layer"
        raise UserError(f"lora: {spec.name} has nothing to adapt: {what}")
    return wrapped


def merged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict with every adapter merged into its weight (W + B A) and no adapter keys: the plain module's."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_a"):
            prefix = key[: -len(".lora_a")]
            a, b = state[key], state[prefix + ".lora_b"]
            w = out[prefix + ".weight"]
            out[prefix + ".weight"] = (w.float() + b.float() @ a.float()).to(w.dtype)
    return out
