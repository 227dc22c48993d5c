"""What every rival device process does around its training loop: the store, the process group, the clock,
and agreeing on each iteration's loss and length; it reports in the runtime's events (engine/events.py)."""

from __future__ import annotations

import io
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.events import DeviceDone, DeviceStart, Iteration
from engine.metrics import measured_throughput
from engine.models import get_model
from engine.runtime.config import DeviceConfig
from engine.runtime.emulation import Clock, group_timeout, now
from engine.runtime.stage import calibrated_clock


def store(cfg: DeviceConfig) -> dist.Store:
    """The launcher's rendezvous store, under the rival's own prefix."""
    timeout = timedelta(seconds=cfg.options.timeout_s)
    tcp = dist.TCPStore(cfg.host, cfg.port, cfg.world_size, False, timeout=timeout)
    return dist.PrefixStore(f"rivals/{cfg.plan.method}", tcp)


def clock(cfg: DeviceConfig, store: dist.Store, module: nn.Module, shape_in: tuple | None, last: bool) -> Clock:
    """The given dilation, or one calibrated like the runtime's (`stage.calibrated_clock`)."""
    st, opts = cfg.steps, cfg.options
    spec = get_model(cfg.plan.model)
    return calibrated_clock(
        opts.dilation, spec, module, st.samples, shape_in, last, st.forward_s, st.backward_s,
        store, cfg.rank, cfg.world_size, opts.seed,
    )  # fmt: skip


def join(cfg: DeviceConfig, store: dist.Store, clock: Clock) -> None:
    """The process group, once the dilation is known: its timeout lets a device wait out dilated iterations."""
    timeout = timedelta(seconds=group_timeout(cfg.options.timeout_s, clock.dilation, cfg.predicted_iteration_s))
    dist.init_process_group("gloo", store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class Iterations:
    """Agrees on each iteration's loss, end time and late steps across ranks; rank 0 reports them."""

    def __init__(self, cfg: DeviceConfig, store: dist.Store, clock: Clock, emit):
        self.cfg, self.store, self.clock, self.emit = cfg, store, clock, emit
        self.t0 = self.last_end = _max_over_ranks(now())
        self.times: list[float] = []
        emit(DeviceStart(cfg.steps.name, cfg.rank, cfg.steps.stage, clock.dilation, os.getpid()).to_message())

    def finish(self, k: int, loss_part: float) -> None:
        totals = torch.tensor([loss_part, self.clock.late, self.clock.steps], dtype=torch.float64)
        dist.all_reduce(totals)
        end = _max_over_ranks(now())
        seconds = self.clock.device(end - self.last_end)
        self.last_end = end
        self.times.append(seconds)
        if self.cfg.rank == 0:
            batch = self.cfg.plan.batch_size
            self.emit(
                Iteration(
                    iteration=k,
                    loss=float(totals[0]),
                    iteration_s=seconds,
                    throughput=batch / seconds,
                    late_steps=int(totals[1]),
                    steps=int(totals[2]),
                    time=self.clock.device(end - self.t0),
                    measured_throughput=measured_throughput(batch, self.times),
                ).to_message()
            )

    def done(self, state: dict | None) -> None:
        data = b""
        if state is not None:
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getvalue()
        clock = self.clock
        self.emit(
            DeviceDone(self.cfg.steps.name, clock.late, clock.steps, clock.overrun_s, state_dict=data).to_message()
        )
        # Leave only once every rank is past the last collective: gloo may still be flushing sends, and a
        # closed connection fails a peer's pending receive (a barrier would have the same problem).
        self.store.set(f"finished/{self.cfg.rank}", "1")
        self.store.wait([f"finished/{r}" for r in range(self.cfg.world_size)])
        dist.destroy_process_group()
