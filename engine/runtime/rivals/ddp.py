"""PyTorch DDP as a rival: `DistributedDataParallel` over the whole model, each device its share of the batch.

A comm hook does the real all-reduce of each gradient bucket and completes the bucket no earlier than the
ring all-reduce of its bytes takes on the emulated link. Buckets use the link one at a time, and a bucket
is ready at the point of the device's padded backward that matches when it was really ready. DDP waits
for every bucket at the end of `backward()`, so the backward is padded in the last bucket's hook (all
gradients are computed by then) and a helper thread completes the buckets' futures. Each device times the
link from its own ready times; the slowest device, which sets the iteration time, is the one whose
buckets really start last.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from engine import recipe
from engine.costmodel import ring_allreduce_s
from engine.data import get_dataset
from engine.devices import Cluster
from engine.errors import UserError
from engine.lora import merged
from engine.models import get_model
from engine.runtime.batches import batch_indices, load
from engine.runtime.config import DeviceConfig
from engine.runtime.emulation import Clock, now
from engine.runtime.rivals import sync


class _LinkShaper:
    """State of the DDP comm hook: shapes each gradient bucket's all-reduce to the emulated ring on the link."""

    def __init__(self, clock: Clock, cluster: Cluster, world: int, backward_s: float):
        self.clock, self.cluster, self.world, self.backward_s = clock, cluster, world, backward_s
        self.start = 0.0  # wall time this iteration's backward started
        self.buckets: list = []
        self.link_free = 0.0  # wall time the last shaped bucket ends

    def begin_backward(self) -> None:
        self.start, self.buckets = now(), []

    def schedule(self) -> None:
        """Called at the last bucket: every gradient is computed. Pads the backward, then times the buckets.

        A bucket is ready at the same fraction of the padded backward as it really was of the real one;
        it starts on the link when ready and the previous bucket is done. A helper thread completes each
        bucket's future when its real all-reduce is done and its emulated one has ended.
        """
        real = max(now() - self.start, 1e-9)
        end = self.clock.pad(self.start, self.backward_s)  # sleeps; no compute is left in this backward
        timed = []
        for t, tensor, work, future in self.buckets:
            ready = self.start + (t - self.start) / real * (end - self.start)
            self.link_free = max(ready, self.link_free) + self.clock.wall(
                ring_allreduce_s(self.cluster, tensor.nbytes, self.world)
            )
            timed.append((tensor, work, future, self.link_free))
        threading.Thread(target=_complete_buckets, args=(timed,), daemon=True).start()


def _shaped_allreduce(shaper, bucket):  # no annotations: DDP compares them with the real classes
    """DDP comm hook: start the real (summing) all-reduce of the bucket now, complete it when shaped."""
    tensor = bucket.buffer().div_(shaper.world)  # the sum of the ranks' weighted losses / world: the batch mean
    work = dist.all_reduce(tensor, async_op=True)
    future = torch.futures.Future()
    shaper.buckets.append((now(), tensor, work, future))
    if bucket.is_last():
        shaper.schedule()
    return future


def _complete_buckets(timed: list) -> None:
    for tensor, work, future, end in timed:
        try:
            work.wait()
        except RuntimeError as exc:  # a peer went away: the backward raises it
            future.set_exception(exc)
            continue
        delay = end - now()
        if delay > 0:
            time.sleep(delay)
        future.set_result(tensor)


def train(cfg: DeviceConfig, emit) -> None:
    plan, st, opts = cfg.plan, cfg.steps, cfg.options
    spec = get_model(plan.model)
    data = get_dataset(opts.dataset, spec, root=opts.data_dir, size=opts.dataset_size, seed=opts.seed)
    torch.manual_seed(opts.seed)  # every process builds the same model; dropout draws then follow this stream
    if opts.precision != "fp32":
        raise UserError("the DDP rival trains in fp32 here: run it with precision fp32")
    layers = spec.layers()
    recipe.prepare(spec, layers, opts)
    model = nn.Sequential(*layers)
    model.train()
    store = sync.store(cfg)
    clock = sync.clock(cfg, store, model, None, last=True)
    sync.join(cfg, store, clock)
    ddp = nn.parallel.DistributedDataParallel(model)
    shaper = _LinkShaper(clock, plan.cluster, cfg.world_size, st.backward_s)
    ddp.register_comm_hook(shaper, _shaped_allreduce)
    params = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = recipe.make_optimizer(params, opts)
    # Each rank's loss is weighted by its share; the hook divides the sum by the world size, so the
    # result is the gradient of the whole batch's mean loss, whatever the shares.
    weight = st.samples / plan.batch_size
    its = sync.Iterations(cfg, store, clock, emit)
    for k in range(opts.iterations):
        x, y = load(data, batch_indices(len(data), plan.batch_size, opts.seed, k)[st.lo : st.hi])
        start = now()
        loss = spec.loss(ddp(x), y) * weight
        clock.pad(start, st.forward_s)
        shaper.begin_backward()
        (loss * cfg.world_size).backward()  # returns once DDP has every shaped bucket back
        clock.wait_until(shaper.link_free)
        clip = recipe.clip_coefficient(recipe.squares(params), opts.clip_grad_norm)  # every rank has every gradient
        recipe.step(optimizer, params, opts, k, clip)
        its.finish(k, float(loss.detach()))
    its.done(merged(model.state_dict()) if opts.save_model and cfg.rank == 0 else None)  # adapters merged
