"""A stage's backward in two halves for the zero-bubble schedules: B, the input gradient, now; W, the weights', later.

B runs torch.distributed.pipelining's `stage_backward_input`: autograd computes the gradient of the stage's
input alone and keeps, at each node that leads to a weight, the gradient that node received. W runs
`stage_backward_weight` from those saved gradients, so no part of the backward is computed twice and the
gradients are those of one whole backward. The first stage's input is data, whose gradient nobody needs:
its B only keeps the output gradient, and its W runs the whole backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


class SplitBackward:
    """The pending W of each micro-batch of one stage, between its B and its W."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.pending: dict[int, tuple] = {}

    def input_gradient(self, mb: int, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """B of micro-batch `mb`: the gradient of the stage's input `x` (None where `x` takes none) given the
        output's (`grad`; None where `out` is the loss)."""
        if not x.requires_grad:
            self.pending[mb] = ("whole", out, grad)
            return None
        if out._is_view():  # the function detaches the output in place, which a view refuses; its copy does not
            out = out.clone()
        (dx,), groups = stage_backward_input([out], None if grad is None else [grad], [x], iter(self.params))
        self.pending[mb] = ("weights", groups)
        return dx

    def weight_gradient(self, mb: int) -> None:
        """W of micro-batch `mb`: its weight gradients, added to the parameters' `.grad`."""
        item = self.pending.pop(mb)
        if item[0] == "whole":
            _, out, grad = item
            out.backward(grad)
        else:
            stage_backward_weight(iter(self.params), item[1])
