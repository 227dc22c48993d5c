"""Real peers for the benchmark: PyTorch DDP and torch.distributed.pipelining 1F1B under the same time dilation.

    result = run_ddp(workload("mobilenetv2"), CLUSTERS["D"], batch_size=16, iterations=4)
    result = run_pipelining(workload("mobilenetv2"), CLUSTERS["D"], batch_size=16, micro_batches=4)

Each peer runs one process per device, like the Asteroid launcher, and pads every compute step to the
device time of `engine.steps.device_steps` of its equivalent plan (`ddp_plan`, `pipelining_plan`), so
its measured iteration time (wall / dilation) is comparable with the runtime's and with the cost model.

- DDP: `DistributedDataParallel` over the whole model, each device its share of the batch. A comm hook
  does the real all-reduce of each gradient bucket and completes the bucket no earlier than the ring
  all-reduce of its bytes takes on the emulated link. Buckets use the link one at a time, and a bucket
  is ready at the point of the device's padded backward that matches when it was really ready. DDP
  waits for every bucket at the end of `backward()`, so the backward is padded in the last bucket's
  hook (all gradients are computed by then) and a helper thread completes the buckets' futures. Each
  device times the link from its own ready times; the slowest device, which sets the iteration time,
  is the one whose buckets really start last.
- Pipelining: `PipelineStage` + `Schedule1F1B`, one stage per device. Limitation: torch's schedule does
  its own sends, so a link transfer is charged to the sender as extra time padded onto the step that
  produces it (forward: the activations, backward: the input gradient). The peer's transfers never
  overlap its compute, which is what the cost model assumes as well. The first stage asks for the
  gradient of its input (a little extra compute) so that its padded backward ends after its last layer.
"""

from __future__ import annotations

import io
import queue as queue_mod
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.costmodel import Workload, score
from engine.data import get_dataset
from engine.devices import Cluster
from engine.errors import UserError
from engine.models import get_model
from engine.plan import Plan, Share, Stage
from engine.runtime.batches import batch_indices, load
from engine.runtime.emulation import Clock, auto_dilation, group_timeout, measure_ratio, now
from engine.runtime.launcher import process_context
from engine.steps import DeviceSteps, device_steps

LR, MOMENTUM = 0.05, 0.9
DATASET_SIZE = 2048


@dataclass
class PeerResult:
    """What a peer run measured, in device seconds, next to the cost model's prediction for its plan."""

    method: str  # "ddp" or "pipelining"
    iteration_s: list[float]  # measured device-time seconds per iteration (wall / dilation)
    loss: list[float]  # global mean loss per iteration
    late_steps: int  # compute steps whose real time overran dilation * device time (summed over devices)
    steps: int  # compute steps padded (summed over devices)
    predicted_iteration_s: float  # the cost model's prediction for the equivalent plan
    dilation: float
    batch_size: int = 0
    state_dict: dict | None = field(default=None, repr=False)  # the trained model, when asked for

    @property
    def measured_iteration_s(self) -> float:
        """Median iteration, leaving out the first (warm-up) when there are three or more."""
        return statistics.median(self.iteration_s[1:] if len(self.iteration_s) >= 3 else self.iteration_s)

    @property
    def throughput(self) -> float:
        return self.batch_size / self.measured_iteration_s


# -- the equivalent plans ------------------------------------------------------------------------------


def ddp_plan(workload: Workload, cluster: Cluster, batch_size: int) -> Plan:
    """One stage of every device holding the whole model, equal shares (remainder to the first devices)."""
    g = len(cluster.devices)
    if batch_size < g:
        raise UserError(f"ddp: batch size {batch_size} is smaller than the {g} devices of cluster {cluster.name}")
    q, extra = divmod(batch_size, g)
    shares = tuple(Share(d.name, q + (k < extra)) for k, d in enumerate(cluster.devices))
    return Plan("ddp", workload.model, batch_size, 1, (Stage(0, workload.num_layers, shares),), cluster)


def pipelining_plan(workload: Workload, cluster: Cluster, batch_size: int, micro_batches: int) -> Plan:
    """One device per stage in cluster order, layers split evenly by count (as torch's pipelining examples do)."""
    L = workload.num_layers
    devices = cluster.devices[:L]
    S = len(devices)
    if micro_batches < S:
        raise UserError(f"pipelining: 1F1B over {S} stages needs at least {S} micro-batches, got {micro_batches}")
    if batch_size % micro_batches:
        raise UserError(f"pipelining: batch size {batch_size} is not divisible into {micro_batches} micro-batches")
    bounds = [k * L // S for k in range(S + 1)]
    m = batch_size // micro_batches
    stages = tuple(Stage(bounds[k], bounds[k + 1], (Share(d.name, m),)) for k, d in enumerate(devices))
    return Plan("pipelining", workload.model, batch_size, micro_batches, stages, cluster)


# -- running a peer (the parent process) ---------------------------------------------------------------


def run_ddp(
    workload: Workload,
    cluster: Cluster,
    batch_size: int,
    iterations: int = 4,
    dilation: float | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    dataset: str = "synthetic",
    return_state: bool = False,
) -> PeerResult:
    """Train with PyTorch DDP on every device of `cluster` under time dilation (calibrated when None)."""
    plan = ddp_plan(workload, cluster, batch_size)
    return _run(plan, workload, iterations, dilation, timeout_s, seed, dataset, return_state)


def run_pipelining(
    workload: Workload,
    cluster: Cluster,
    batch_size: int,
    micro_batches: int,
    iterations: int = 4,
    dilation: float | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    dataset: str = "synthetic",
    return_state: bool = False,
) -> PeerResult:
    """Train with torch.distributed.pipelining (1F1B, even split) under time dilation (calibrated when None)."""
    plan = pipelining_plan(workload, cluster, batch_size, micro_batches)
    return _run(plan, workload, iterations, dilation, timeout_s, seed, dataset, return_state)


@dataclass(frozen=True)
class _Config:
    """What one peer device process needs."""

    plan: Plan
    steps: DeviceSteps
    rank: int
    port: int
    iterations: int
    dilation: float | None
    timeout_s: float
    seed: int
    dataset: str
    return_state: bool
    predicted_iteration_s: float

    @property
    def world_size(self) -> int:
        return len(self.plan.device_names)


def _run(
    plan: Plan,
    workload: Workload,
    iterations: int,
    dilation: float | None,
    timeout_s: float,
    seed: int,
    dataset: str,
    return_state: bool,
) -> PeerResult:
    if iterations < 1:
        raise UserError(f"iterations must be at least 1, got {iterations}")
    if dilation is not None and not dilation > 0:
        raise UserError(f"dilation must be positive, got {dilation}")
    prediction = score(plan, workload)
    if not prediction.fits:
        over = [n for n, b in prediction.memory_bytes.items() if b > plan.cluster.device(n).memory_bytes]
        raise UserError(
            f"{plan.method}: batch size {plan.batch_size} does not fit in memory on {', '.join(over)}: "
            "use a smaller batch size"
        )
    steps = device_steps(plan, workload)
    names = plan.device_names
    ctx = process_context()
    events = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    procs = []
    for rank, name in enumerate(names):
        cfg = _Config(
            plan, steps[name], rank, store.port, iterations, dilation, timeout_s, seed, dataset, return_state,
            prediction.iteration_s,
        )  # fmt: skip
        procs.append(ctx.Process(target=_child, args=(cfg, events), name=f"peer-{plan.method}-{name}", daemon=True))
    for p in procs:
        p.start()
    result = PeerResult(plan.method, [], [], 0, 0, prediction.iteration_s, dilation or 0.0, plan.batch_size)
    try:
        _collect(procs, names, events, result, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        events.close()
    return result


def _collect(procs: list, names: list[str], events, result: PeerResult, timeout_s: float) -> None:
    """Fill `result` from the processes' events; raise UserError when a device fails, dies or stalls."""
    done: set[int] = set()
    parts: dict = {}
    last_event = time.monotonic()
    while len(done) < len(procs):
        try:
            ev = events.get(timeout=0.2)
        except queue_mod.Empty:
            ev = None
        t = time.monotonic()
        if ev is None:
            dead = [k for k, p in enumerate(procs) if p.exitcode not in (None, 0) and k not in done]
            if dead and t - last_event > 2.0:  # gone without a report (its last words had time to arrive)
                k = dead[0]
                raise UserError(
                    f"{result.method} peer: device {names[k]} (rank {k}) died (exit code {procs[k].exitcode})"
                )
            quiet = timeout_s + group_timeout(timeout_s, result.dilation, result.predicted_iteration_s)
            if t - last_event > quiet:  # longer than any gloo operation may wait
                raise UserError(f"{result.method} peer: stalled, no device reported anything for {quiet:.0f} s")
            continue
        last_event = t
        kind = ev["type"]
        if kind == "error":
            raise UserError(f"{result.method} peer: device {ev['device']} failed: {ev['message']}")
        if kind == "start":
            result.dilation = ev["dilation"]
        elif kind == "iteration":
            result.iteration_s.append(ev["iteration_s"])
            result.loss.append(ev["loss"])
        elif kind == "done":
            done.add(ev["rank"])
            result.late_steps += ev["late_steps"]
            result.steps += ev["steps"]
            if ev["state"]:
                parts.update(torch.load(io.BytesIO(ev["state"]), weights_only=True))
    if parts:
        result.state_dict = parts


# -- one device process --------------------------------------------------------------------------------


def _child(cfg: _Config, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)  # several devices share the host's cores; more threads only contend
    code = 0
    try:
        (_train_ddp if cfg.plan.method == "ddp" else _train_pipelining)(cfg, events.put)
    except Exception as exc:  # reported to the parent, which raises it
        message = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        events.put({"type": "error", "device": cfg.steps.name, "rank": cfg.rank, "message": message})
        code = 1
    events.close()
    events.join_thread()
    sys.exit(code)


def _store(cfg: _Config) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", cfg.port, cfg.world_size, False, timeout=timedelta(seconds=cfg.timeout_s))
    return dist.PrefixStore(f"peers/{cfg.plan.method}", store)


def _join(cfg: _Config, store: dist.Store, clock: Clock) -> None:
    """The process group, once the dilation is known: its timeout lets a device wait out dilated iterations."""
    timeout = timedelta(seconds=group_timeout(cfg.timeout_s, clock.dilation, cfg.predicted_iteration_s))
    dist.init_process_group("gloo", store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _calibrated_clock(cfg: _Config, store, module: nn.Module, shape_in: tuple | None, last: bool) -> Clock:
    """The given dilation, or one calibrated like the runtime's (each device measured alone, worst ratio)."""
    if cfg.dilation is not None:
        return Clock(cfg.dilation)
    st, spec = cfg.steps, get_model(cfg.plan.model)
    gen = torch.Generator().manual_seed(cfg.seed + 7919 * (cfg.rank + 1))

    def step() -> tuple[float, float]:
        x, y = spec.example_batch(st.samples, gen)
        if shape_in is not None:  # a later pipeline stage: activations in
            x = torch.randn((st.samples, *shape_in), generator=gen, requires_grad=True)
        t = now()
        out = module(x)
        t_f = now()
        if last:
            spec.loss(out, y).backward()
        else:
            out.backward(torch.randn(out.shape, generator=gen))
        return t_f - t, now() - t_f

    with torch.random.fork_rng(devices=[]):  # dropout draws leave training's random stream as it was
        state = {k: v.clone() for k, v in module.state_dict().items()}
        ratio = measure_ratio(step, st.forward_s, st.backward_s, store, cfg.rank, cfg.world_size)
        module.zero_grad(set_to_none=True)
        module.load_state_dict(state)  # batch-norm statistics as they were
    return Clock(auto_dilation(ratio, cfg.world_size))


class _Iterations:
    """Agrees on each iteration's loss and end time across ranks; rank 0 reports them."""

    def __init__(self, cfg: _Config, store: dist.Store, clock: Clock, emit):
        self.cfg, self.store, self.clock, self.emit = cfg, store, clock, emit
        self.last_end = _max_over_ranks(now())
        if cfg.rank == 0:
            emit({"type": "start", "dilation": clock.dilation})

    def finish(self, k: int, loss_part: float) -> None:
        loss = torch.tensor([loss_part], dtype=torch.float64)
        dist.all_reduce(loss)
        end = _max_over_ranks(now())
        seconds = self.clock.device(end - self.last_end)
        self.last_end = end
        if self.cfg.rank == 0:
            self.emit({"type": "iteration", "iteration": k, "loss": float(loss), "iteration_s": seconds})

    def done(self, state: dict | None) -> None:
        data = b""
        if state is not None:
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getvalue()
        self.emit(
            {
                "type": "done",
                "rank": self.cfg.rank,
                "late_steps": self.clock.late,
                "steps": self.clock.steps,
                "state": data,
            }
        )
        # Leave only once every rank is past the last collective: gloo may still be flushing sends, and a
        # closed connection fails a peer's pending receive (a barrier would have the same problem).
        self.store.set(f"finished/{self.cfg.rank}", "1")
        self.store.wait([f"finished/{r}" for r in range(self.cfg.world_size)])
        dist.destroy_process_group()


# -- DDP ---------------------------------------------------------------------------------------------


class _LinkShaper:
    """State of the DDP comm hook: shapes each gradient bucket's all-reduce to the emulated ring on the link."""

    def __init__(self, clock: Clock, cluster: Cluster, world: int, backward_s: float):
        self.clock, self.cluster, self.world, self.backward_s = clock, cluster, world, backward_s
        self.start = 0.0  # wall time this iteration's backward started
        self.buckets: list = []
        self.link_free = 0.0  # wall time the last shaped bucket ends

    def ring_s(self, nbytes: int) -> float:
        g, c = self.world, self.cluster
        return 2 * (g - 1) / g * nbytes / c.bytes_per_s + 2 * (g - 1) * c.latency_s

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
            self.link_free = max(ready, self.link_free) + self.clock.wall(self.ring_s(tensor.nbytes))
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


def _train_ddp(cfg: _Config, emit) -> None:
    plan, st = cfg.plan, cfg.steps
    spec = get_model(plan.model)
    data = get_dataset(cfg.dataset, spec, size=DATASET_SIZE, seed=cfg.seed)
    torch.manual_seed(cfg.seed)  # every process builds the same model; dropout draws then follow this stream
    model = nn.Sequential(*spec.layers())
    model.train()
    store = _store(cfg)
    clock = _calibrated_clock(cfg, store, model, None, last=True)
    _join(cfg, store, clock)
    ddp = nn.parallel.DistributedDataParallel(model)
    shaper = _LinkShaper(clock, plan.cluster, cfg.world_size, st.backward_s)
    ddp.register_comm_hook(shaper, _shaped_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    # Each rank's loss is weighted by its share; the hook divides the sum by the world size, so the
    # result is the gradient of the whole batch's mean loss, whatever the shares.
    weight = st.samples / plan.batch_size
    its = _Iterations(cfg, store, clock, emit)
    for k in range(cfg.iterations):
        x, y = load(data, batch_indices(len(data), plan.batch_size, cfg.seed, k)[st.lo : st.hi])
        start = now()
        loss = spec.loss(ddp(x), y) * weight
        clock.pad(start, st.forward_s)
        shaper.begin_backward()
        (loss * cfg.world_size).backward()  # returns once DDP has every shaped bucket back
        clock.wait_until(shaper.link_free)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        its.finish(k, float(loss.detach()))
    its.done(model.state_dict() if cfg.return_state and cfg.rank == 0 else None)


# -- pipelining ----------------------------------------------------------------------------------------


class _BackwardStarts(torch.autograd.Function):
    """Identity at the stage output; its backward runs first in the stage's backward and notes the time."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.stage.backward_start = now()
        return grad, None


class _BackwardEnds(torch.autograd.Function):
    """Identity at the stage input; its backward runs last in the stage's backward and pads it."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        stage.clock.pad(stage.backward_start, stage.backward_s)
        return grad, None


class _PaddedStage(nn.Module):
    """A stage's layers whose forward and backward take the device's time (plus its outgoing transfer)."""

    def __init__(self, layers: nn.Sequential, clock: Clock, forward_s: float, backward_s: float):
        super().__init__()
        self.layers, self.clock, self.forward_s, self.backward_s = layers, clock, forward_s, backward_s
        self.backward_start = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = now()
        if x.is_floating_point():
            # The first stage's input has no gradient; one is asked for so the backward reaches the pad.
            x = _BackwardEnds.apply(x if x.requires_grad else x.detach().requires_grad_(), self)
            out = self.layers(x)
        else:  # token ids: the backward is padded after the embedding (the first layer)
            out = self.layers[1:](_BackwardEnds.apply(self.layers[0](x), self))
        self.clock.pad(start, self.forward_s)
        return _BackwardStarts.apply(out, self)


def _boundary_examples(
    spec, layers: list[nn.Module], start: int, end: int, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example micro-batch tensors entering and leaving layers [start, end) (static shapes for PipelineStage)."""
    x, _ = spec.example_batch(1, torch.Generator().manual_seed(0))
    example_in = x
    with torch.no_grad():
        for k in range(end):
            if k == start:
                example_in = x
            layers[k].eval()  # no batch-norm statistics updated by the probe
            x = layers[k](x)
            layers[k].train()

    def example(t: torch.Tensor, activation: bool) -> torch.Tensor:
        # torch takes whether a gradient flows across the boundary from the examples' requires_grad
        return torch.zeros((m, *t.shape[1:]), dtype=t.dtype, requires_grad=activation and t.is_floating_point())

    return example(example_in, start > 0), example(x, True)


def _train_pipelining(cfg: _Config, emit) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    plan, st = cfg.plan, cfg.steps
    stage_plan = plan.stages[st.stage]
    first, last = st.stage == 0, st.stage == len(plan.stages) - 1
    spec = get_model(plan.model)
    data = get_dataset(cfg.dataset, spec, size=DATASET_SIZE, seed=cfg.seed) if first or last else None
    torch.manual_seed(cfg.seed)
    layers = spec.layers()
    example_in, example_out = _boundary_examples(spec, layers, stage_plan.start, stage_plan.end, plan.micro_batch_size)
    module = nn.Sequential(*layers[stage_plan.start : stage_plan.end])
    del layers
    module.train()
    store = _store(cfg)
    clock = _calibrated_clock(cfg, store, module, None if first else tuple(example_in.shape[1:]), last)
    _join(cfg, store, clock)
    # The sender pays for the link: its outgoing transfer is padded onto the step that produces it.
    forward_s = st.forward_s + sum(t.seconds for t in st.send_forward)
    backward_s = st.backward_s + sum(t.seconds for t in st.send_backward)
    padded = _PaddedStage(module, clock, forward_s, backward_s)
    stage = PipelineStage(
        padded, st.stage, len(plan.stages), torch.device("cpu"), input_args=example_in, output_args=example_out
    )
    # Every stage gets the loss: torch runs the backward only when the schedule has a loss function.
    schedule = Schedule1F1B(stage, plan.micro_batches, loss_fn=spec.loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    its = _Iterations(cfg, store, clock, emit)
    for k in range(cfg.iterations):
        args, target, losses = (), None, []
        if data is not None:
            x, y = load(data, batch_indices(len(data), plan.batch_size, cfg.seed, k))
            args, target = ((x,) if first else ()), (y if last else None)
        schedule.step(*args, target=target, losses=losses if last else None, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        its.finish(k, float(torch.stack(losses).detach().mean()) if last else 0.0)
    state = None
    if cfg.return_state:
        state = {}
        for key, value in module.state_dict().items():
            index, rest = key.split(".", 1)
            state[f"{int(index) + stage_plan.start}.{rest}"] = value
    its.done(state)
