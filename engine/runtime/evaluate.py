"""The device's held-out evaluation: batch-norm statistics recomputed on the training batch, then whole batches
forward through the pipeline in eval mode, the totals agreed like an iteration's."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from engine.data import get_dataset
from engine.events import Eval
from engine.runtime.batches import batch_indices, eval_batches, load
from engine.runtime.emulation import now

EVAL_TAG = 1 << 21  # tags of the held-out evaluation's activations


class Evaluation:
    """Mixin of the device (engine.runtime.worker). Needs its stage, `data`, `test`, `spec`, `opts`, `clock`,
    the `train` group, the messages (engine.runtime.links) and the wait helpers."""

    def _evaluate(self, k: int) -> None:
        """Score the model after iteration k on the first held-out samples: batch by batch, forward only through
        the pipeline in eval mode (no dropout, batch-norm running statistics), each last-stage device on its
        slice; the totals are agreed like an iteration's. Its device time is left out of the next iteration.

        Batch norm's running statistics trail a model whose weights move fast (early in training they describe
        weights long gone), so they are first recomputed on iteration k's training batch ("precise BN"): the
        same forward-only pass, batch norm averaging over it, no dropout. Training does not use them."""
        if self.test is None:
            opts = self.opts
            self.test = get_dataset(opts.dataset, self.spec, opts.data_dir, opts.dataset_size, opts.seed, train=False)
        plan = self.plan
        begin = now()
        totals = torch.zeros(3, dtype=torch.float64)  # loss (per sample, summed), right answers, samples

        def score(out: torch.Tensor, y: torch.Tensor) -> None:
            totals[0] += float(self.spec.loss(out, y)) * len(y)
            if self.spec.task != "language-modeling":
                totals[1] += int((out.argmax(-1) == y).sum())
            totals[2] += len(y)

        self.quiet = True
        try:
            if any(isinstance(m, _BatchNorm) for layer in self.layers for m in layer.modules()):
                self._recompute_batch_norm(k)
            self.module.eval()
            batches = eval_batches(len(self.test), plan.batch_size, self.opts.eval_samples)
            self._forward_only(
                self.test, [torch.arange(b * plan.batch_size, (b + 1) * plan.batch_size) for b in range(batches)], k,
                score,
            )  # fmt: skip
        finally:
            self.quiet = False
            self.module.train()
        self._wait(self._allreduce(totals, self.train), "the evaluation's sync")
        end = torch.tensor([now()], dtype=torch.float64)
        self._wait(self._allreduce(end, self.train, dist.ReduceOp.MAX), "the evaluation's sync")
        self.last_end = float(end)
        if self.rank == 0:
            n = int(totals[2])
            loss = float(totals[0]) / n
            finite = math.isfinite(loss)
            language = self.spec.task == "language-modeling"
            self.emit(
                Eval(
                    iteration=k,
                    loss=loss if finite else None,
                    accuracy=None if language else float(totals[1]) / n,
                    perplexity=math.exp(loss) if language and finite and loss < 700 else None,
                    samples=n,
                    device_s=self.clock.device(float(end) - begin),
                    generation=self.gen.number,
                ).to_message()
            )

    def _recompute_batch_norm(self, k: int) -> None:
        """Batch norm's running statistics of this stage, recomputed as the average over iteration k's batch."""
        norms = [m for m in self.module.modules() if isinstance(m, _BatchNorm)]
        momenta = [m.momentum for m in norms]
        self.module.eval()  # no dropout
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the micro-batches of the pass
            m.train()
        try:
            indices = batch_indices(len(self.data), self.plan.batch_size, self.opts.seed, k)
            self._forward_only(self.data, [indices], k)
        finally:
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum

    def _forward_only(self, data, batches: list[torch.Tensor], k: int, score=None) -> None:
        """Run whole batches (sample indices of `data`) forward through the pipeline without gradients, each
        device on its slices; the last stage hands each output and its labels to `score`."""
        plan, st, m = self.plan, self.st, self.plan.micro_batch_size
        with torch.no_grad():
            for indices in batches:
                pending = self.post_receives(backward=False, base=EVAL_TAG)
                outbox: list = []
                for mb in range(plan.micro_batches):
                    mine = indices[mb * m + st.lo : mb * m + st.hi]
                    x = self.place.load(load(data, mine)[0]) if self.first else self.receive(pending, "F", mb)
                    timer = self.place.timer()
                    with self.precision.autocast():
                        out = self.module(x)
                    if self.last and score is not None:
                        score(out, self.place.load(load(data, mine)[1]))
                    self.clock.pad(timer.started(), self._compute_s(st.forward_s, k))
                    if not self.last:
                        self.send(out, st.send_forward, "F", mb, outbox, base=EVAL_TAG)
                for peer, _, work in outbox:
                    self._wait(work, f"delivery to {peer}")
