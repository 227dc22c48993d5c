"""The stage's gradient all-reduce: one flat tensor on the stage's group, in float32 or through torch's DDP
compression hooks, and its emulated time on the ring."""

from __future__ import annotations

import torch

from engine.costmodel import ring_allreduce_s
from engine.plan import ALLREDUCE
from engine.runtime.emulation import now


class Hooked:
    """A communication hook's future (torch.futures.Future) as the work `_wait` waits for."""

    def __init__(self, future) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.wait()


def compress_hook(allreduce: str):
    """torch's DDP communication hook for the stage all-reduce's wire format (engine.plan.ALLREDUCE)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[allreduce]


class StageAllReduce:
    """Mixin of the device (engine.runtime.worker). Needs `stage_group`, `params`, `plan`, `cluster`, `stage`,
    `clock` and the device's `_fault`, `_event` and wait helpers."""

    def _reduce_gradients(self, k: int) -> None:
        if self.stage_group is None or not self.params:
            if self.stage_group is None:
                self._fault(k, "all-reduce")
            return
        start = now()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        size = self.stage_group.size()
        if self.plan.allreduce == "off":
            work = self._allreduce(flat, self.stage_group)
        else:  # the hook sends 16-bit floats and averages (as DDP does); the stage sums its devices' gradients
            hook = compress_hook(self.plan.allreduce)
            work = Hooked(self._post(hook, "an all-reduce", self.stage_group, (flat,)))
        self._fault(k, "all-reduce")
        self._wait(work, "the stage all-reduce")
        if self.plan.allreduce != "off":
            flat.mul_(size)
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        # ring all-reduce of the gradient bytes on the wire, as the cost model charges it
        names = tuple(d.name for d in self.plan.stages[self.stage].devices)  # the ring runs at its slowest link
        seconds = ring_allreduce_s(self.cluster, flat.numel() * ALLREDUCE[self.plan.allreduce], size, names)
        end = self.clock.pad(now(), seconds, compute=False)
        self._event("all-reduce", -1, start, end)
