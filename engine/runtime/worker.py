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
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.data import get_dataset
from engine.errors import UserError
from engine.events import StepEvent
from engine.models import get_model
from engine.plan import Plan
from engine.runtime.batches import batch_indices, load
from engine.runtime.emulation import Clock, MemoryMeter, auto_dilation, group_timeout, measure_ratio, now
from engine.schedule import one_f_one_b
from engine.steps import DeviceSteps

Emit = Callable[[dict], None]
OPTIMIZER_STATES = 1  # SGD with momentum keeps one buffer per parameter


@dataclass(frozen=True)
class DeviceConfig:
    """Everything one device process needs to take part in a run."""

    plan: Plan
    steps: DeviceSteps
    rank: int
    host: str
    port: int
    generation: int = 0
    iterations: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    dataset: str = "synthetic"
    data_dir: str | None = None
    dataset_size: int = 2048
    emulate: bool = False
    dilation: float | None = None  # None with emulate: calibrate at start-up
    enforce_memory: bool = True
    timeout_s: float = 60.0
    serve_store: bool = False  # this process hosts the rendezvous store (rank 0 when there is no launcher)
    save_parts: bool = False
    predicted_iteration_s: float = 1.0  # device seconds; bounds how long a healthy device may wait for data

    @property
    def world_size(self) -> int:
        return len(self.plan.device_names)

    def rank_of(self, name: str) -> int:
        """Ranks follow the plan's device order."""
        return self.plan.device_names.index(name)


class PeerLost(RuntimeError):
    """A collective or point-to-point operation failed because another device went away."""


def stage_module(layers: list[nn.Module], start: int, end: int) -> nn.Sequential:
    return nn.Sequential(*layers[start:end])


def part_state_dict(module: nn.Sequential, start: int) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers under the unpartitioned model's keys ("<layer index>.<name>")."""
    out = {}
    for key, value in module.state_dict().items():
        index, rest = key.split(".", 1)
        out[f"{int(index) + start}.{rest}"] = value.detach().clone()
    return out


def _boundary_shapes(spec, layers: list[nn.Module], start: int, end: int) -> tuple[tuple, tuple]:
    """Per-sample shapes of the stage's input and output (one sample through the layers before and in it)."""
    x, _ = spec.example_batch(1, torch.Generator().manual_seed(0))
    shape_in = tuple(x.shape[1:])
    with torch.no_grad():
        for k in range(end):
            if k == start:
                shape_in = tuple(x.shape[1:])
            layers[k].eval()  # no batch-norm statistics updated by the probe
            x = layers[k](x)
            layers[k].train()
    return shape_in, tuple(x.shape[1:])


class _Device:
    """State of one device during a run (kept on an object so the schedule loop reads simply)."""

    def __init__(self, cfg: DeviceConfig, emit: Emit):
        self.cfg, self.emit = cfg, emit
        plan, st = cfg.plan, cfg.steps
        self.plan, self.st, self.cluster = plan, st, plan.cluster
        self.name, self.stage = st.name, st.stage
        self.stage_plan = plan.stages[self.stage]
        self.num_stages = len(plan.stages)
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.spec = get_model(plan.model)
        torch.manual_seed(cfg.seed)  # every process builds the same full model, then keeps its layers
        layers = self.spec.layers()
        self.shape_in, self.shape_out = _boundary_shapes(self.spec, layers, self.stage_plan.start, self.stage_plan.end)
        self.module = stage_module(layers, self.stage_plan.start, self.stage_plan.end)
        del layers
        self.module.train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=cfg.lr, momentum=cfg.momentum) if self.params else None
        self.data = None
        if self.first or self.last:
            self.data = get_dataset(cfg.dataset, self.spec, root=cfg.data_dir, size=cfg.dataset_size, seed=cfg.seed)
            if len(self.data) < plan.batch_size:
                raise UserError(
                    f"dataset {cfg.dataset!r} has {len(self.data)} samples, fewer than one batch of {plan.batch_size}"
                )
        device = plan.cluster.device(self.name)
        budget = device.memory_bytes if cfg.emulate and cfg.enforce_memory else None
        self.memory = MemoryMeter(self.name, budget, self.params, OPTIMIZER_STATES)
        self.clock = Clock(None)
        self.t0 = 0.0
        self.iteration = -1

    # -- process groups -------------------------------------------------------------------------------

    def connect(self) -> None:
        """Reach the rendezvous store; this run's keys live under `asteroid/gen<generation>/`."""
        cfg = self.cfg
        timeout = timedelta(seconds=cfg.timeout_s)
        store = dist.TCPStore(cfg.host, cfg.port, cfg.world_size, cfg.serve_store, timeout=timeout)
        self.store = dist.PrefixStore(f"asteroid/gen{cfg.generation}", store)

    def make_groups(self) -> None:
        """The process group of every device (messages, iteration sync) and one per multi-device stage
        (all-reduce), with a timeout that lets a device wait out (dilated) iterations for its data."""
        cfg = self.cfg
        timeout = timedelta(seconds=group_timeout(cfg.timeout_s, self.clock.dilation, cfg.predicted_iteration_s))
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
        """Agree on the dilation: the given one, or one from each device's measured host/device time ratio.
        Either way the stage first runs once untimed, so no padded step pays for a cold start."""
        cfg = self.cfg
        if not cfg.emulate:
            return
        gen = torch.Generator().manual_seed(cfg.seed + 7919 * (cfg.rank + 1))
        n = self.st.samples

        def step() -> tuple[float, float]:
            if self.first:
                x, y = self.spec.example_batch(n, gen)
            else:
                x = torch.randn((n, *self.shape_in), generator=gen, requires_grad=True)
                y = self.spec.example_batch(n, gen)[1]
            t = now()
            out = self.module(x)
            t_f = now()
            if self.last:
                self.spec.loss(out, y).backward()
            else:
                out.backward(torch.randn(out.shape, generator=gen))
            return t_f - t, now() - t_f

        state = {k: v.clone() for k, v in self.module.state_dict().items()}
        with torch.random.fork_rng(devices=[]):  # dropout draws leave training's random stream as it was
            if cfg.dilation is not None:
                step()  # warm-up only: the allocator, lazy initialisation
            else:
                try:
                    ratio = measure_ratio(
                        step, self.st.forward_s, self.st.backward_s, self.store, cfg.rank, cfg.world_size
                    )
                except RuntimeError as exc:  # the store: a device that never came
                    raise PeerLost(f"calibration failed: {_gloo_message(exc)}") from None
        self.module.zero_grad(set_to_none=True)
        self.module.load_state_dict(state)  # batch-norm statistics as they were
        self.clock = Clock(cfg.dilation if cfg.dilation is not None else auto_dilation(ratio, cfg.world_size))

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
            seconds = self.cluster.latency_s + payload.numel() * payload.element_size() / self.cluster.bytes_per_s
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
        self.emit(
            StepEvent(
                self.name,
                self.stage,
                mb,
                kind,
                self.clock.device(start - self.t0),
                self.clock.device(end - self.t0),
                peer,
                self.iteration,
            ).to_message()
        )

    def _slice(self, indices: torch.Tensor, mb: int) -> torch.Tensor:
        m = self.plan.micro_batch_size
        return indices[mb * m + self.st.lo : mb * m + self.st.hi]

    def run_iteration(self, k: int) -> None:
        plan, st, clock = self.plan, self.st, self.clock
        self.iteration = k
        indices = batch_indices(len(self.data), plan.batch_size, self.cfg.seed, k) if self.data is not None else None
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
            g = self.stage_group.size()
            nbytes = flat.numel() * flat.element_size()
            seconds = 2 * (g - 1) / g * nbytes / self.cluster.bytes_per_s + 2 * (g - 1) * self.cluster.latency_s
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
        if self.cfg.rank == 0:
            self.emit(
                {
                    "type": "iteration",
                    "iteration": k,
                    "loss": float(totals[0]),
                    "iteration_s": seconds,
                    "throughput": self.plan.batch_size / seconds,
                    "late_steps": int(totals[1]),
                    "steps": int(totals[2]),
                    "time": self.clock.device(end_t - self.t0),
                }
            )

    def run(self) -> None:
        cfg = self.cfg
        self.connect()
        self.calibrate()
        self.make_groups()
        start = torch.tensor([now()], dtype=torch.float64)
        _wait(dist.all_reduce(start, op=dist.ReduceOp.MAX, async_op=True), "the start-up sync")
        self.t0 = self.last_end = float(start)
        self.emit(
            {
                "type": "device-start",
                "device": self.name,
                "rank": cfg.rank,
                "stage": self.stage,
                "dilation": self.clock.dilation,
                "pid": os.getpid(),
            }
        )
        for k in range(cfg.iterations):
            self.run_iteration(k)
        part = b""
        if cfg.save_parts and self.st.lo == 0:  # the first device of each stage saves the stage's layers
            buf = io.BytesIO()
            torch.save(part_state_dict(self.module, self.stage_plan.start), buf)
            part = buf.getvalue()
        self.emit(
            {
                "type": "device-done",
                "device": self.name,
                "late_steps": self.clock.late,
                "steps": self.clock.steps,
                "overrun_s": self.clock.overrun_s,
                "peak_memory_bytes": self.memory.peak,
                "state_dict": part,
            }
        )
        _wait(dist.barrier(async_op=True), "the final barrier")
        dist.destroy_process_group()


def _gloo_message(exc: Exception) -> str:
    """gloo's first sentence without its source location: "Connection closed by peer [127.0.0.1]:60099"."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return text.split(". ")[0].rstrip(".")


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo: connection closed by a dead peer, or the group timeout
        raise PeerLost(f"{what} failed: {_gloo_message(exc)}") from None


def _comm(op, what: str, *args, **kwargs):
    """Post a point-to-point operation; a peer that is already gone raises PeerLost."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as exc:
        raise PeerLost(f"{what} failed: {_gloo_message(exc)}") from None


def run_device(cfg: DeviceConfig, emit: Emit) -> int:
    """Run one device to the end; report a failure as a `device-error` event. Returns an exit status."""
    torch.set_num_threads(1)  # several devices share the host's cores; more threads only contend
    device = None
    try:
        device = _Device(cfg, emit)
        device.run()
        return 0
    except Exception as exc:  # reported, not raised: the launcher or agent decides what it means
        own = not isinstance(exc, PeerLost | dist.DistError)
        emit(
            {
                "type": "device-error",
                "device": cfg.steps.name,
                "iteration": device.iteration if device is not None else -1,
                "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                "cause": "own" if own else "peer",
                "traceback": "" if isinstance(exc, UserError | PeerLost) else traceback.format_exc(),
            }
        )
        return 1
