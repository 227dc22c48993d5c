"""A stage's backward in two halves for the zero-bubble schedules: B, the input gradient, now; W, the weights', later.

B runs torch.distributed.pipelining's `stage_backward_input`: autograd computes the gradient of the stage's
input alone and keeps, at each node that leads to a weight, the gradient that node received. W runs
`stage_backward_weight` from those saved gradients, so no part of the backward is computed twice and the
gradients are those of one whole backward. The first stage's input is data, whose gradient nobody needs:
its B only keeps the output gradient, and its W runs the whole backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    stage_backward_input,
    stage_backward_weight,
)


class SplitBackward:
    """The pending W of each micro-batch of one stage, between its B and its W."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.pending: dict[int, tuple] = {}

    def input_gradient(self, mb: int, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """B of micro-batch `mb`: the gradient of the stage's input `x` (None where `x` takes none) given the
        output's (`grad`; None where `out` is the loss)."""
        grad = grad.to(out.dtype) if grad is not None else None  # a 16-bit output takes a 16-bit gradient
        if not x.requires_grad:
            self.pending[mb] = ("whole", out, grad)
            return None
        if out._is_view():  # the function detaches the output in place, which a view refuses; its copy does not
            out = out.clone()
        (dx,), groups = stage_backward_input([out], None if grad is None else [grad], [x], iter(self.params))
        self.pending[mb] = ("weights", groups)
        return dx

    def weight_gradient(self, mb: int, final: Callable[[list], None] | None = None) -> None:
        """W of micro-batch `mb`: its weight gradients, added to the parameters' `.grad`, group of weights by group
        (torch's order), `final` hearing of each weight once the last group that adds to it is done."""
        item = self.pending.pop(mb)
        if item[0] == "whole":
            _, out, grad = item
            if out.requires_grad:  # not where every weight up to here is frozen
                out.backward(grad)
            return
        nodes = {_get_grad_fn_or_grad_acc(p): p for p in self.params}
        left = Counter(n for group in item[1] for n in group["params"])
        for group in item[1]:
            weights = list(group["params"])
            stage_backward_weight(iter(self.params), [group])
            left.subtract(weights)
            if final is not None:
                final([nodes[n] for n in weights if n in nodes and left[n] == 0])


class SplitSteps:
    """Mixin of the device (engine.runtime.worker): its B and W steps under a zero-bubble schedule. Needs its
    stage (`st`, `first`, `last`, `clock`, `memory`, `place`), the messages (engine.runtime.links) and `_fault`,
    `_event`, `_compute_s`."""

    def _split_step(self, act, k: int, split: SplitBackward, pending, inputs, outputs, outbox) -> None:
        """B (the input gradient, sent back at once) or W (the weight gradients) of the action's micro-batch; the
        last W sends the stage's gradients to its ring as they are final (engine.runtime.allreduce)."""
        st, clock, kind, mb = self.st, self.clock, act.kind, act.micro_batch
        if kind == "B":
            grad = None if self.last else self.receive(pending, "B", mb)
            timer = self.place.timer()
            dx = split.input_gradient(mb, outputs.pop(mb), grad, inputs[mb])
            start = timer.started()  # on a GPU: from its CUDA events (engine.runtime.placement)
            self._fault(k, "backward")
            if self.first:  # its whole backward is W: B only took the gradient in
                return
            end = clock.pad(start, self._compute_s(st.backward_s - st.weight_s, k))
            self._event("B", mb, start, end)
            self.send(dx, st.send_backward, "B", mb, outbox)
        else:
            timer = self.place.timer()
            with self._finals(act) as final:
                split.weight_gradient(mb, final)
            start = timer.started()
            inputs.pop(mb)
            self.memory.release(mb)
            end = clock.pad(start, self._compute_s(st.weight_s, k))
            self._stepped(act, start, end)
            self._event("W", mb, start, end)
