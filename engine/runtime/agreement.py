"""The end of an iteration: every device agrees on its loss, late steps, the coordinator's stop request, the
global gradient norm (engine.recipe's clipping) and fp16's overflow (engine.runtime.precision): the commit point."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import recipe
from engine.events import Iteration
from engine.metrics import measured_throughput
from engine.runtime.emulation import now


class Agreement:
    """Mixin of the device (engine.runtime.worker). Needs `hb`, `opts`, `params`, `precision`, `clock`, `train`,
    `plan`, `gen`, `rank`, `times`, `last_end`, `t0`, `emit`, `_norm_params` and the wait helpers; sets `clip`."""

    def _agree(self, k: int, loss_sum: float) -> bool:
        """The end-of-iteration agreement (the commit point): loss, late steps, the stop request, the end time.
        Rank 0 reports the iteration. Returns whether every device stops after this iteration."""
        asked = self.hb is not None and self.hb.stop_at is not None and k >= self.hb.stop_at
        squares = recipe.squares(self._norm_params()) if self.opts.clip_grad_norm > 0 else 0.0
        found = self.precision.overflowed(self.params)
        totals = torch.tensor([loss_sum, self.clock.late, self.clock.steps, float(asked), squares, found],
                              dtype=torch.float64)  # fmt: skip
        self._wait(self._allreduce(totals, self.train), "the end-of-iteration sync")
        end = torch.tensor([now()], dtype=torch.float64)
        self._wait(self._allreduce(end, self.train, dist.ReduceOp.MAX), "the end-of-iteration sync")
        end_t = float(end)
        scale = self.precision.scale  # the squares are of scaled gradients; an overflow skips every stage's step
        clip = recipe.clip_coefficient(float(totals[4]) / scale**2, self.opts.clip_grad_norm)
        unscale = self.precision.step(float(totals[5]))
        self.clip = None if unscale is None else clip * unscale
        seconds = self.clock.device(end_t - self.last_end)
        self.last_end = end_t
        self.times.append(seconds)
        if self.rank == 0:
            self.emit(
                Iteration(
                    iteration=k,
                    loss=float(totals[0]),
                    iteration_s=seconds,
                    throughput=self.plan.batch_size / seconds,
                    late_steps=int(totals[1]),
                    steps=int(totals[2]),
                    time=self.clock.device(end_t - self.t0),
                    measured_throughput=measured_throughput(self.plan.batch_size, self.times),
                    generation=self.gen.number,
                    skipped=self.clip is None,
                    loss_scale=self.precision.scale if self.precision.scaling else None,
                ).to_message()
            )
        return bool(totals[3] > 0)
