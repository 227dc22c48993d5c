"""torch.distributed.pipelining as a rival: `PipelineStage` + `Schedule1F1B`, one stage per device.

Limitation: torch's schedule does its own sends, so a link transfer is charged to the sender as extra time
padded onto the step that produces it (forward: the activations, backward: the input gradient). The
rival's transfers never overlap its compute, which is what the cost model assumes as well. The first stage
asks for the gradient of its input (a little extra compute) so that its padded backward ends after its
last layer. On gloo, `PipelineStage` needs static shapes (`input_args`/`output_args`) or it hangs.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import recipe
from engine.data import get_dataset
from engine.errors import UserError
from engine.models import get_model
from engine.runtime.batches import batch_indices, load
from engine.runtime.config import DeviceConfig
from engine.runtime.emulation import Clock, now
from engine.runtime.rivals import sync
from engine.runtime.stage import boundary_examples, part_state_dict, stage_module


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `hook()` when the gradient passes: at a stage's output that is the first
    thing of its backward, at its input the last."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


class _PaddedStage(nn.Module):
    """A stage's layers whose forward and backward take the device's time (plus its outgoing transfer)."""

    def __init__(self, layers: nn.Sequential, clock: Clock, forward_s: float, backward_s: float):
        super().__init__()
        self.layers, self.clock, self.forward_s, self.backward_s = layers, clock, forward_s, backward_s
        self.backward_start = 0.0

    def _backward_starts(self) -> None:
        self.backward_start = now()

    def _backward_ends(self) -> None:
        self.clock.pad(self.backward_start, self.backward_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = now()
        if x.is_floating_point():
            # The first stage's input has no gradient; one is asked for so the backward reaches the pad.
            x = _OnBackward.apply(x if x.requires_grad else x.detach().requires_grad_(), self._backward_ends)
            out = self.layers(x)
        else:  # token ids: the backward is padded after the embedding (the first layer)
            out = self.layers[1:](_OnBackward.apply(self.layers[0](x), self._backward_ends))
        self.clock.pad(start, self.forward_s)
        return _OnBackward.apply(out, self._backward_starts)


def _example(t: torch.Tensor, m: int, activation: bool) -> torch.Tensor:
    """A micro-batch of `t`'s shape and dtype; torch takes whether a gradient flows across the boundary
    from the examples' requires_grad."""
    return torch.zeros((m, *t.shape[1:]), dtype=t.dtype, requires_grad=activation and t.is_floating_point())


def train(cfg: DeviceConfig, emit) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    plan, st, opts = cfg.plan, cfg.steps, cfg.options
    stage_plan = plan.stages[st.stage]
    first, last = st.stage == 0, st.stage == len(plan.stages) - 1
    spec = get_model(plan.model)
    data = (
        get_dataset(opts.dataset, spec, root=opts.data_dir, size=opts.dataset_size, seed=opts.seed)
        if first or last
        else None
    )
    if opts.clip_grad_norm > 0:  # it would need the norm over every stage, which torch's schedule does not agree
        raise UserError("torch.distributed.pipelining (the rival) does not clip gradients: run it with no clipping")
    if opts.precision != "fp32":
        raise UserError("torch.distributed.pipelining (the rival) trains in fp32 here: run it with precision fp32")
    torch.manual_seed(opts.seed)
    layers = spec.layers()
    recipe.prepare(spec, layers, opts)
    x_in, x_out = boundary_examples(spec, layers, stage_plan.start, stage_plan.end)
    module = stage_module(layers, stage_plan.start, stage_plan.end)
    del layers
    module.train()
    store = sync.store(cfg)
    clock = sync.clock(cfg, store, module, None if first else tuple(x_in.shape[1:]), last)
    sync.join(cfg, store, clock)
    # The sender pays for the link: its outgoing transfer is padded onto the step that produces it.
    forward_s = st.forward_s + sum(t.seconds for t in st.send_forward)
    backward_s = st.backward_s + sum(t.seconds for t in st.send_backward)
    padded = _PaddedStage(module, clock, forward_s, backward_s)
    m = plan.micro_batch_size
    stage = PipelineStage(
        padded,
        st.stage,
        len(plan.stages),
        torch.device("cpu"),
        input_args=_example(x_in, m, not first),
        output_args=_example(x_out, m, True),
    )
    # Every stage gets the loss: torch runs the backward only when the schedule has a loss function.
    schedule = Schedule1F1B(stage, plan.micro_batches, loss_fn=spec.loss)
    optimizer = recipe.make_optimizer([p for p in module.parameters() if p.requires_grad], opts)
    its = sync.Iterations(cfg, store, clock, emit)
    for k in range(opts.iterations):
        args, target, losses = (), None, []
        if data is not None:
            x, y = load(data, batch_indices(len(data), plan.batch_size, opts.seed, k))
            args, target = ((x,) if first else ()), (y if last else None)
        schedule.step(*args, target=target, losses=losses if last else None, return_outputs=False)
        recipe.step(optimizer, [], opts, k, 1.0)
        its.finish(k, float(torch.stack(losses).detach().mean()) if last else 0.0)
    its.done(part_state_dict(module, stage_plan.start) if opts.save_model else None)
