"""A module torch.fx cannot trace (Python control flow on tensor values), cut at its top-level children when
they form a chain: each child one layer, one tensor across each cut, the child's own names kept.

    chain = children_chain(module, example, why)     # `why`: fx's one-line complaint, said if no chain either
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UserError
from engine.models.graph import Value


class _Holder(nn.Module):
    """One child under its own attribute name, so that its keys are the module's (`encoder.0.weight`)."""

    def __init__(self, name: str, child: nn.Module):
        super().__init__()
        self.add_module(name, child)
        self._child = name

    def forward(self, x):
        return getattr(self, self._child)(x)


@dataclass(frozen=True)
class Children:
    """The chain of a module's top-level children (the same interface as engine.models.graph.Chain)."""

    children: tuple[str, ...]
    cuts: tuple[tuple[Value, ...], ...]
    aliases: tuple[tuple[str, ...], ...] = ()
    ties: tuple = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple((i, i + 1) for i in range(len(self.children)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"{i}:{name}" for i, name in enumerate(self.children))

    def layers(self, module: nn.Module) -> list[nn.Module]:
        layers = []
        for i, name in enumerate(self.children):
            layer = _Holder(name, getattr(module, name))
            layer.label = self.names[i]
            layers.append(layer)
        return layers

    def exact(self, boundary: int) -> bool:
        return any(not v.dtype.is_floating_point for v in self.cuts[boundary - 1])


def children_chain(module: nn.Module, example: torch.Tensor, why: UserError) -> Children:
    """The module's children as its chain, when running them one after the other is running the module (on
    `example`); else `why`, with the children's reason."""
    children = list(module.named_children())
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if len(children) < 2 or own:
        reason = f"its own {own[0]} belongs to no child" if own else "it has fewer than two children"
        raise UserError(f"{why}; nor can it be cut at its top-level children: {reason}") from None
    was = module.training
    module.eval()
    cuts = []
    try:
        with torch.no_grad():
            whole = module(example)
            x = example
            for k, (name, child) in enumerate(children):
                x = child(x)
                if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == example.shape[0]):
                    raise UserError(f"{why}; nor can it be cut at its top-level children: {name} does not return "
                                    "one tensor of the batch")  # fmt: skip
                if k < len(children) - 1:
                    cuts.append((Value(k, tuple(x.shape[1:]), x.dtype),))
    finally:
        module.train(was)
    if not (isinstance(whole, torch.Tensor) and whole.shape == x.shape and torch.allclose(whole, x)):
        raise UserError(f"{why}; nor can it be cut at its top-level children: run one after the other, they do not "
                        "compute what the module does")  # fmt: skip
    return Children(tuple(name for name, _ in children), tuple(cuts))
