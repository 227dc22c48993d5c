"""One device's part of a hybrid-pipeline run: its stage's layers, 1F1B over its sample slices, stage all-reduce.

Every device process runs `run_device`. Ranks follow the plan's device order. The process group lives
under the store prefix `asteroid/gen<generation>` so survivors of a failure can form a fresh group on
the same store. Activations go to the next stage and gradients come back as point-to-point messages
(a float64 header with the emulated arrival time, then the payload); all receives of an iteration are
posted when it starts, so data arrives while the device computes. Inside a stage, gradients are summed
with one all-reduce on the stage's subgroup; the last stage's loss is `sum over its samples / batch`,
so the result equals one device training on the whole batch.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.costmodel import link_s, ring_allreduce_s
from engine.data import get_dataset
from engine.errors import UserError
from engine.events import DeviceDone, DeviceStart, Iteration, StepEvent
from engine.metrics import measured_throughput
from engine.models import get_model
from engine.plan import Plan
from engine.runtime.batches import batch_indices, load
from engine.runtime.emulation import Clock, MemoryMeter, group_timeout, now
from engine.runtime.options import RunOptions
from engine.runtime.processes import error_event
from engine.runtime.stage import (
    PeerLost,
    boundary_examples,
    calibrated_clock,
    gloo_message,
    part_state_dict,
    stage_module,
)
from engine.schedule import one_f_one_b
from engine.steps import DeviceSteps

Emit = Callable[[dict], None]
OPTIMIZER_STATES = 1  # SGD with momentum keeps one buffer per parameter


@dataclass(frozen=True)
class DeviceConfig:
    """Everything one device process needs to take part in a run: the run's options and its own place in it."""

    plan: Plan
    steps: DeviceSteps
    rank: int
    host: str
    port: int
    options: RunOptions = RunOptions()
    serve_store: bool = False  # this process hosts the rendezvous store (rank 0 when there is no launcher)
    predicted_iteration_s: float = 1.0  # device seconds; bounds how long a healthy device may wait for data

    @property
    def world_size(self) -> int:
        return len(self.plan.device_names)

    def rank_of(self, name: str) -> int:
        """Ranks follow the plan's device order."""
        return self.plan.device_names.index(name)


class _Device:
    """State of one device during a run (kept on an object so the schedule loop reads simply)."""

    def __init__(self, cfg: DeviceConfig, emit: Emit):
        self.cfg, self.opts, self.emit = cfg, cfg.options, emit
        plan, st, opts = cfg.plan, cfg.steps, cfg.options
        self.plan, self.st, self.cluster = plan, st, plan.cluster
        self.name, self.stage = st.name, st.stage
        self.stage_plan = plan.stages[self.stage]
        self.num_stages = len(plan.stages)
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.spec = get_model(plan.model)
        torch.manual_seed(opts.seed)  # every process builds the same full model, then keeps its layers
        layers = self.spec.layers()
        x_in, x_out = boundary_examples(self.spec, layers, self.stage_plan.start, self.stage_plan.end)
        self.shape_in, self.shape_out = tuple(x_in.shape[1:]), tuple(x_out.shape[1:])
        self.module = stage_module(layers, self.stage_plan.start, self.stage_plan.end)
        del layers
        self.module.train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=opts.lr, momentum=opts.momentum) if self.params else None
        self.data = None
        if self.first or self.last:
            self.data = get_dataset(opts.dataset, self.spec, root=opts.data_dir, size=opts.dataset_size, seed=opts.seed)
            if len(self.data) < plan.batch_size:
                raise UserError(
                    f"dataset {opts.dataset!r} has {len(self.data)} samples, fewer than one batch of {plan.batch_size}"
                )
        device = plan.cluster.device(self.name)
        budget = device.memory_bytes if opts.emulate and opts.enforce_memory else None
        self.memory = MemoryMeter(self.name, budget, self.params, OPTIMIZER_STATES)
        self.clock = Clock(None)
        self.t0 = 0.0
        self.iteration = -1
        self.times: list[float] = []  # device seconds of each finished iteration

    # -- process groups -------------------------------------------------------------------------------

    def connect(self) -> None:
        """Reach the rendezvous store; this run's keys live under `asteroid/gen<generation>/`."""
        cfg = self.cfg
        timeout = timedelta(seconds=self.opts.timeout_s)
        store = dist.TCPStore(cfg.host, cfg.port, cfg.world_size, cfg.serve_store, timeout=timeout)
        self.store = dist.PrefixStore(f"asteroid/gen{self.opts.generation}", store)

    def make_groups(self) -> None:
        """The process group of every device (messages, iteration sync) and one per multi-device stage
        (all-reduce), with a timeout that lets a device wait out (dilated) iterations for its data."""
        cfg = self.cfg
        timeout = timedelta(seconds=group_timeout(self.opts.timeout_s, self.clock.dilation, cfg.predicted_iteration_s))
        dist.init_process_group("gloo", store=self.store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)
        self.group = None  # the default group
        self.stage_group = None
        for st in self.plan.stages:  # every rank creates every group, in the same order
            ranks = sorted(cfg.rank_of(s.name) for s in st.devices)
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if st is self.stage_plan:
                self.stage_group = group

    # -- emulation set-up -----------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Agree on the dilation (`stage.calibrated_clock`); a real device's clock pads nothing."""
        cfg, opts, st = self.cfg, self.opts, self.st
        if not opts.emulate:
            return
        shape_in = None if self.first else self.shape_in
        self.clock = calibrated_clock(
            opts.dilation, self.spec, self.module, st.samples, shape_in, self.last, st.forward_s, st.backward_s,
            self.store, cfg.rank, cfg.world_size, opts.seed,
        )  # fmt: skip

    # -- messages -------------------------------------------------------------------------------------

    def _tag(self, micro_batch: int, kind: str, part: int) -> int:
        return (micro_batch * 2 + (kind == "B")) * 2 + part

    def post_receives(self) -> dict:
        """Post every receive of the iteration now; returns (kind, mb) -> [(lo, hi, header, payload, works)]."""
        pending = {}
        for mb in range(self.plan.micro_batches):
            for kind, moves, shape in (
                ("F", self.st.recv_forward, self.shape_in),
                ("B", self.st.recv_backward, self.shape_out),
            ):
                got = []
                for t in moves:
                    peer = self.cfg.rank_of(t.peer)
                    header = torch.zeros(1, dtype=torch.float64)
                    payload = torch.empty((t.hi - t.lo, *shape))
                    what = f"receiving from {t.peer}"
                    works = [
                        _comm(dist.irecv, what, header, peer, self.group, tag=self._tag(mb, kind, 0)),
                        _comm(dist.irecv, what, payload, peer, self.group, tag=self._tag(mb, kind, 1)),
                    ]
                    got.append((t, header, payload, works))
                pending[(kind, mb)] = got
        return pending

    def receive(self, pending: dict, kind: str, mb: int) -> torch.Tensor | None:
        """Wait for every slice of (kind, mb), and until the emulated link delivered it; the slices in order."""
        got = pending.pop((kind, mb))
        if not got:
            return None
        start = now()
        arrival = 0.0
        for t, header, _, works in got:
            for w in works:
                _wait(w, f"{'activations' if kind == 'F' else 'gradients'} from {t.peer}")
            arrival = max(arrival, float(header[0]))
        end = self.clock.wait_until(arrival)
        if end - start > 1e-4:
            self._event("recv", mb, start, end)
        return torch.cat([payload for _, _, payload, _ in got]) if len(got) > 1 else got[0][2]

    def send(self, tensor: torch.Tensor, moves, kind: str, mb: int, outbox: list) -> None:
        """Send each peer its slice; the device is busy for the emulated transfer time of each."""
        for t in moves:
            start = now()
            payload = tensor[t.lo - self.st.lo : t.hi - self.st.lo].detach().contiguous()
            # the link carries the real payload: latency + bytes / bandwidth, in device seconds
            seconds = link_s(self.cluster, payload.numel() * payload.element_size())
            arrival = start + self.clock.wall(seconds) if self.clock.emulated else 0.0
            header = torch.tensor([arrival], dtype=torch.float64)
            peer = self.cfg.rank_of(t.peer)
            what = f"sending to {t.peer}"
            for part, tensor_part in enumerate((header, payload)):
                work = _comm(dist.isend, what, tensor_part, peer, self.group, tag=self._tag(mb, kind, part))
                outbox.append((t.peer, tensor_part, work))  # the tensor stays alive until the send completes
            end = self.clock.wait_until(arrival)
            self._event("send", mb, start, end, peer=t.peer)

    # -- the schedule ---------------------------------------------------------------------------------

    def _event(self, kind: str, mb: int, start: float, end: float, peer: str = "") -> None:
        t0, clock = self.t0, self.clock
        step = StepEvent(
            self.name, self.stage, mb, kind, clock.device(start - t0), clock.device(end - t0), peer, self.iteration
        )
        self.emit(step.to_message())

    def _slice(self, indices: torch.Tensor, mb: int) -> torch.Tensor:
        m = self.plan.micro_batch_size
        return indices[mb * m + self.st.lo : mb * m + self.st.hi]

    def run_iteration(self, k: int) -> None:
        plan, st, clock = self.plan, self.st, self.clock
        self.iteration = k
        indices = batch_indices(len(self.data), plan.batch_size, self.opts.seed, k) if self.data is not None else None
        pending = self.post_receives()
        outbox: list = []
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        loss_sum = 0.0
        for act in one_f_one_b(self.num_stages, plan.micro_batches)[self.stage]:
            mb = act.micro_batch
            if act.kind == "F":
                if self.first:
                    x = load(self.data, self._slice(indices, mb))[0]
                else:
                    x = self.receive(pending, "F", mb)
                    x.requires_grad_(True)
                y = load(self.data, self._slice(indices, mb))[1] if self.last else None
                start = now()
                with self.memory.forward(mb):
                    out = self.module(x)
                    if self.last:
                        # sum over this device's samples / global batch: the mean-loss gradient of the whole batch
                        out = self.spec.loss(out, y) * (st.samples / plan.batch_size)
                        loss_sum += float(out.detach())
                inputs[mb], outputs[mb] = x, out
                end = clock.pad(start, st.forward_s)
                self._event("F", mb, start, end)
                self.send(out, st.send_forward, "F", mb, outbox)
            else:
                grad = None if self.last else self.receive(pending, "B", mb)
                start = now()
                out = outputs.pop(mb)
                if self.last:
                    out.backward()
                else:
                    out.backward(grad)
                x = inputs.pop(mb)
                self.memory.release(mb)
                end = clock.pad(start, st.backward_s)
                self._event("B", mb, start, end)
                if not self.first:
                    self.send(x.grad, st.send_backward, "B", mb, outbox)
        for peer, _, work in outbox:
            _wait(work, f"delivery to {peer}")
        if self.stage_group is not None and self.params:
            start = now()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            _wait(dist.all_reduce(flat, group=self.stage_group, async_op=True), "the stage all-reduce")
            offset = 0
            for p, g in zip(self.params, grads):
                p.grad = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
            # ring all-reduce of the real gradient bytes, as the cost model charges it
            seconds = ring_allreduce_s(self.cluster, flat.numel() * flat.element_size(), self.stage_group.size())
            end = clock.pad(now(), seconds, compute=False)
            self._event("all-reduce", -1, start, end)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.finish_iteration(k, loss_sum)

    def finish_iteration(self, k: int, loss_sum: float) -> None:
        """Agree on the iteration's loss, end time and late steps; rank 0 reports the iteration."""
        totals = torch.tensor([loss_sum, self.clock.late, self.clock.steps], dtype=torch.float64)
        _wait(dist.all_reduce(totals, group=self.group, async_op=True), "the end-of-iteration sync")
        end = torch.tensor([now()], dtype=torch.float64)
        _wait(dist.all_reduce(end, dist.ReduceOp.MAX, self.group, async_op=True), "the end-of-iteration sync")
        end_t = float(end)
        seconds = self.clock.device(end_t - self.last_end)
        self.last_end = end_t
        self.times.append(seconds)
        if self.cfg.rank == 0:
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
                ).to_message()
            )

    def run(self) -> None:
        cfg = self.cfg
        self.connect()
        self.calibrate()
        self.make_groups()
        start = torch.tensor([now()], dtype=torch.float64)
        _wait(dist.all_reduce(start, op=dist.ReduceOp.MAX, async_op=True), "the start-up sync")
        self.t0 = self.last_end = float(start)
        self.emit(DeviceStart(self.name, cfg.rank, self.stage, self.clock.dilation, os.getpid()).to_message())
        for k in range(self.opts.iterations):
            self.run_iteration(k)
        part = b""
        if self.opts.save_model and self.st.lo == 0:  # the first device of each stage saves the stage's layers
            buf = io.BytesIO()
            torch.save(part_state_dict(self.module, self.stage_plan.start), buf)
            part = buf.getvalue()
        clock = self.clock
        self.emit(
            DeviceDone(
                self.name, clock.late, clock.steps, clock.overrun_s, self.memory.peak, state_dict=part
            ).to_message()
        )
        _wait(dist.barrier(async_op=True), "the final barrier")
        dist.destroy_process_group()


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo: connection closed by a dead peer, or the group timeout
        raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None


def _comm(op, what: str, *args, **kwargs):
    """Post a point-to-point operation; a peer that is already gone raises PeerLost."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as exc:
        raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None


def run_device(cfg: DeviceConfig, emit: Emit) -> int:
    """Run one device to the end; report a failure as a `device-error` event. Returns an exit status."""
    torch.set_num_threads(1)  # several devices share the host's cores; more threads only contend
    device = None
    try:
        device = _Device(cfg, emit)
        device.run()
        return 0
    except Exception as exc:  # reported, not raised: the launcher or agent decides what it means
        iteration = device.iteration if device is not None else -1
        emit(error_event(cfg.steps.name, iteration, exc, (PeerLost, dist.DistError)))
        return 1
