"""The stage's gradient all-reduce: in buckets sent during the last gradient step, each one flat tensor on the
stage's group, in float32 or through torch's DDP compression hooks, and its emulated time on the ring."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from engine.buckets import finish
from engine.runtime.emulation import now
from engine.steps import stage_actions


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


def tied_groups(spec, plan, name: str) -> list[tuple[tuple, list[str], bool]]:
    """The weights tied across stages that device `name` holds (engine.models.graph.Chain.ties): per tie, the tie,
    the devices of every stage holding it (its all-reduce group) and whether `name` is its stage's first device
    (the one whose stage-summed gradient counts: the others send zeros)."""
    found = []
    for tie in spec.chain.ties if spec.chain is not None else ():
        stages = sorted({s for s, st in enumerate(plan.stages) for i, _ in tie if st.start <= i < st.end})
        names = [d.name for s in stages for d in plan.stages[s].devices]
        if len(stages) > 1 and name in names:
            first = any(plan.stages[s].devices[0].name == name for s in stages)
            found.append((tie, names, first))
    return found


class StageAllReduce:
    """Mixin of the device (engine.runtime.worker). Needs `stage_group`, `params`, `layers`, `place`, `plan`, `st`,
    `cluster`, `stage`, `gen`, `clock`, `link_free` and the device's `_fault`, `_event` and wait helpers.

    The stage's gradients go to its ring in buckets (engine.buckets) during the device's last gradient step of
    the iteration: each bucket, in order, as soon as its gradients and those of every bucket before it are
    final (hooks on the parameters' accumulation; a zero-bubble W says so group by group). An emulated device
    then waits until the end the buckets' ring gives (engine.buckets.finish), from its devices' agreed times."""

    def _finals(self, act) -> contextlib.AbstractContextManager:
        """Around a gradient step: when `act` is the iteration's last one, its buckets go out as they are final
        (the context gives what to call with weights made final, for a W; None for any other step)."""
        if self.stage_group is None or not self.st.buckets or act != self._last_gradient_act():
            return contextlib.nullcontext()
        return self._sending(act)

    @contextlib.contextmanager
    def _sending(self, act):
        self._arm()
        handles = [] if act.kind == "W" and not self.first else [
            p.register_post_accumulate_grad_hook(lambda p: self._final([p])) for p in self.params
        ]  # fmt: skip
        try:
            yield self._final
        finally:
            for h in handles:
                h.remove()
        self._raise_send_error()

    def _arm(self) -> None:
        seen: set[int] = set()  # a weight two of the stage's layers hold (tied) goes in the first one's bucket
        self._buckets = [
            [p for layer in self.layers[b.start : b.end] for p in layer.parameters()
             if p.requires_grad and id(p) not in seen and not seen.add(id(p))]
            for b in self.st.buckets
        ]  # fmt: skip
        self._bucket_of = {id(p): n for n, ps in enumerate(self._buckets) for p in ps}
        self._finished, self._sent, self._send_error = [set() for _ in self._buckets], [], None
        self._gradient_step = None

    def _final(self, params) -> None:
        """These parameters' gradients are final: send every bucket, in order, that now is."""
        for p in params:
            n = self._bucket_of.get(id(p))
            if n is not None:
                self._finished[n].add(id(p))
        try:
            while len(self._sent) < len(self._buckets):
                n = len(self._sent)
                if len(self._finished[n]) < len(self._buckets[n]):
                    break
                self._send_bucket(n)
        except Exception as exc:  # inside autograd: raised once the step is over
            self._send_error = exc

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            raise error

    def _send_bucket(self, n: int) -> None:
        params = self._buckets[n]
        if not params:
            self._sent.append(([], [], None, None))
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        (flat,) = self.place.host([torch.cat([g.reshape(-1) for g in grads])])  # gloo's ring runs on the host
        if self.plan.allreduce == "off":
            work = self._allreduce(flat, self.stage_group)
        else:  # the hook sends 16-bit floats and averages (as DDP does); the stage sums its devices' gradients
            work = Hooked(self._post(compress_hook(self.plan.allreduce), "an all-reduce", self.stage_group, (flat,)))
        self._sent.append((params, grads, flat, work))

    def _last_gradient_act(self):
        """The action of the iteration's last gradient step (B under 1F1B, W under a zero-bubble schedule)."""
        if getattr(self, "_last_act_of", None) != self.gen.number:
            kind = "B" if self.plan.schedule == "1f1b" else "W"
            actions = stage_actions(self.plan, self.gen.steps)[self.stage]
            self._last_act, self._last_act_of = [a for a in actions if a.kind == kind][-1], self.gen.number
        return self._last_act

    def _stepped(self, act, start: float, end: float) -> None:
        """A gradient step ran from `start` to `end` (wall); the last one times the buckets."""
        if self.stage_group is not None and act == self._last_gradient_act():
            self._gradient_step = (start, end)

    def _tie(self, plan, group) -> None:
        """This generation's groups of the weights tied across stages that this device holds (`group(prefix, rank,
        size)` makes one): (group, tie, whether this device speaks for its stage)."""
        self.ties, self.counted_elsewhere = [], set()
        mine = next(st for st in plan.stages if self.name in [d.name for d in st.devices])
        a, b = mine.start, mine.end
        for j, (tie, names, first) in enumerate(tied_groups(self.spec, plan, self.name)):
            self.ties.append((group(f"tie{j}", names.index(self.name), len(names)), tie, first))
            self.abandoned.append(self.ties[-1][0])
            if names[0] != self.name:  # the first stage holding it counts it in the global norm
                self.counted_elsewhere.update(id(self.layers[i].get_parameter(n)) for i, n in tie if a <= i < b)

    def _reduce_ties(self) -> None:
        """A weight several stages hold (a tied embedding) gets the sum of their gradients, each stage's counted once
        (after its own all-reduce, so from its first device), so every copy takes the same step (Megatron's way)."""
        a, b = self.stage_plan.start, self.stage_plan.end
        for group, tie, first in self.ties:
            p = next(self.layers[i].get_parameter(n) for i, n in tie if a <= i < b)
            if first and p.grad is not None:
                (total,) = self.place.host([p.grad.detach().clone()])  # on the host: gloo's
            else:
                total = torch.zeros(p.shape, dtype=p.dtype)
            self._wait(self._allreduce(total, group), "the tied weights' all-reduce")
            p.grad = self.place.load(total)

    def _norm_params(self) -> list:
        """The weights whose gradients this device adds to the global norm (engine.recipe.squares): its stage's,
        from the stage's first device only (after the all-reduce every device holds the same), a tied weight from
        the first stage holding it."""
        if self.st.lo != 0:
            return []
        return [p for p in self.params if id(p) not in self.counted_elsewhere]

    def _reduce_gradients(self, k: int) -> None:
        if self.stage_group is None or not self.params:
            if self.stage_group is None:
                self._fault(k, "all-reduce")
            return
        buckets = self.st.buckets
        if getattr(self, "_buckets", None) is None:  # no step sent any (not one was the last gradient step)
            self._arm()
        self._final(self.params)  # what no hook or W reported (no gradient at all): final now, sent now
        self._raise_send_error()
        self._fault(k, "all-reduce")
        size = self.stage_group.size()
        sent, self._buckets = self._sent, None
        for params, grads, flat, work in sent:
            if work is None:
                continue
            self._wait(work, "the stage all-reduce")
            if self.plan.allreduce != "off":
                flat.mul_(size)
            flat = self.place.load(flat)
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
        # the ring, bucket by bucket, from when every device of the stage had each bucket (engine.buckets)
        a, e = self._gradient_step or (now(), now())
        times = torch.tensor([self.link_free] + [a + b.ready * (e - a) for b in buckets], dtype=torch.float64)
        if self.clock.emulated:
            self._wait(self._allreduce(times, self.stage_group, dist.ReduceOp.MAX), "the stage all-reduce")
        free, ready = float(times[0]), times[1:].tolist()
        end = finish(free, ready, [self.clock.wall(b.seconds) for b in buckets])
        end = self.clock.wait_until(end) if self.clock.emulated else now()
        self._event("all-reduce", -1, min(end, max(free, ready[0])), end)
