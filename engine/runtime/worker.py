"""One device's part of a hybrid-pipeline run: its stage's layers, 1F1B over its sample slices, stage all-reduce,
and, under a coordinator, generations: restore, replicate, roll back and replay after a membership change.

Every device process runs `run_device`. A run is a sequence of generations (`control.Generation`); each has
its own plan, its own process groups on the store prefix `asteroid/gen<N>/` and starts from a restored state.
Activations go to the next stage and gradients come back as point-to-point messages (a float64 header with
the emulated arrival time, then the payload); all receives of an iteration are posted when it starts.
Inside a stage, gradients are summed with one all-reduce on the stage's group; the last stage's loss is
`sum over its samples / batch`, so the result equals one device training on the whole batch.

Commit rule: an iteration ends with an agreement of every device (loss, late steps, the coordinator's stop
request), and only then does each device apply its optimizer step, so a device that hears of a failure
before the agreement rolls back by doing nothing (its weights are still the last committed ones; its
batch-norm statistics are put back). Every K iterations each stage's first device copies its layers to a
neighbour and to the coordinator (the central replica); every device keeps a snapshot of its own layers then.

Without a coordinator (`coordinated=False`: a device of `python -m engine train --rank`, or an agent's) there
is one generation; rank 0 may host the store, and a lost peer ends the run.
"""

from __future__ import annotations

import io
import json
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from engine.compression import decode, encode, wire_bytes
from engine.costmodel import link_s, ring_allreduce_s
from engine.data import get_dataset
from engine.errors import UserError
from engine.events import DeviceDone, DeviceStart, Eval, Iteration, Restore, StepEvent
from engine.metrics import measured_throughput
from engine.models import get_model
from engine.models.randomness import sample_draws
from engine.plan import ALLREDUCE, OFF, Plan, gradient_bits
from engine.runtime import layerstate
from engine.runtime.backward import SplitBackward
from engine.runtime.batches import batch_indices, eval_batches, load
from engine.runtime.control import Generation, Heartbeat, gen_key, get_bytes, key, put_bytes
from engine.runtime.emulation import Clock, MemoryMeter, group_timeout, now, use_time_base
from engine.runtime.faults import Fail
from engine.runtime.options import RunOptions
from engine.runtime.processes import error_event
from engine.runtime.recovery import CENTRAL, SEED, Copy, Piece, neighbour
from engine.runtime.stage import (
    PeerLost,
    boundary_examples,
    calibrated_clock,
    gloo_group,
    gloo_message,
    part_state_dict,
)
from engine.steps import DeviceSteps, stage_actions

Emit = Callable[[dict], None]
OPTIMIZER_STATES = 1  # SGD with momentum keeps one buffer per parameter
REPLICA_TAG = 1 << 20  # tags of the neighbour replica's messages (training messages use small tags)
EVAL_TAG = 1 << 21  # tags of the held-out evaluation's activations
RESTORE_TAG = 1 << 21  # restore piece i uses RESTORE_TAG + 2 i (+1 for its payload)


class Aborted(RuntimeError):
    """The coordinator stopped this generation (a device was lost)."""


class _Waiter:
    """A thread that waits for one gloo work at a time, so the device's own thread can give up on it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="waiter", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, box, done = self._jobs.get()
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - handed back to the device's thread
                box["error"] = exc
            done.set()

    def wait(self, work, abort: threading.Event) -> bool:
        """True once `work` completed (raising its error), False when `abort` came first."""
        box: dict = {}
        done = threading.Event()
        self._jobs.put((work, box, done))
        while not done.wait(0.05):
            if abort.is_set():
                return False
        if "error" in box:
            raise box["error"]
        return True


class _Hooked:
    """A communication hook's future (torch.futures.Future) as the work `_wait` waits for."""

    def __init__(self, future) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.wait()


def _compress_hook(allreduce: str):
    """torch's DDP communication hook for the stage all-reduce's wire format (engine.plan.ALLREDUCE)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[allreduce]


@dataclass(frozen=True)
class DeviceConfig:
    """Everything one device process needs to take part in a run: the run's options and its own place in it."""

    plan: Plan  # the first plan of the run (a coordinated device gets each generation's plan from the store)
    steps: DeviceSteps | None
    rank: int
    host: str
    port: int
    options: RunOptions = RunOptions()
    serve_store: bool = False  # this process hosts the rendezvous store (rank 0 when there is no coordinator)
    predicted_iteration_s: float = 1.0  # device seconds; bounds how long a healthy device may wait for data
    coordinated: bool = False  # a coordinator drives generations through the store (the launcher)
    name: str = ""  # coordinated: this device's name (a device that joins later is in no plan yet)
    fails: tuple[Fail, ...] = ()  # injected failures of this device
    address: str = ""  # the address this board's data plane binds to and advertises (its route to the site)
    time_base: dict | None = None  # this board's clock against the site's (offset_s, drift_ppm, ref_s); None: same host

    @property
    def world_size(self) -> int:
        return len(self.plan.device_names)

    @property
    def device_name(self) -> str:
        return self.name or self.steps.name


def _static_generation(cfg: DeviceConfig) -> Generation:
    """The one generation of a run without a coordinator: the plan as given, from the seed."""
    plan, opts = cfg.plan, cfg.options
    pieces = tuple(
        Piece(s.name, st.start, st.end, SEED, SEED, 0)
        for st in plan.stages
        for s in st.devices
        if s.name == cfg.steps.name
    )
    return Generation(
        number=opts.generation, plan=plan, steps={cfg.steps.name: cfg.steps}, start=0, iterations=opts.iterations,
        pieces=pieces, predicted_iteration_s=cfg.predicted_iteration_s, replicate_every=0, dilation=opts.dilation,
    )  # fmt: skip


class _Device:
    """State of one device across the generations of a run."""

    def __init__(self, cfg: DeviceConfig, emit: Emit):
        self.cfg, self.opts, self.emit = cfg, cfg.options, emit
        self.name = cfg.device_name
        opts = cfg.options
        self.spec = get_model(cfg.plan.model)
        torch.manual_seed(opts.seed)  # every process builds the same full model; it trains the layers it owns
        self.layers = self.spec.layers()
        self.trained: set[int] = set()  # layers whose weights are no longer the seed's
        self.data = get_dataset(opts.dataset, self.spec, root=opts.data_dir, size=opts.dataset_size, seed=opts.seed)
        if len(self.data) < cfg.plan.batch_size:
            raise UserError(
                f"dataset {opts.dataset!r} has {len(self.data)} samples, fewer than one batch of {cfg.plan.batch_size}"
            )
        self.test = None  # the held-out split, loaded at the first evaluation
        self.quiet = False  # no step events (an evaluation's steps are not the iteration's)
        self.clock = Clock(None)
        self.t0 = 0.0
        self.iteration = -1
        self.times: list[float] = []  # device seconds of each finished iteration
        self.live = 0  # iterations whose optimizer step the owned layers have applied
        self.own: tuple[int, int] = (0, 0)  # layers [a, b) this device trains
        self.live_valid = True  # false while a restore is half applied
        self.snapshot: tuple[int, layerstate.LayerStates] | None = None  # own layers at the last replication point
        self.replica: tuple[int, layerstate.LayerStates] | None = None  # the previous stage's, same point
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.nn.Parameter] = []
        self.fired: set[Fail] = set()
        self.hb: Heartbeat | None = None
        self.abandoned: list = []  # process groups of ended generations: never reused, never destroyed
        self.memory: MemoryMeter | None = None
        self.waiter: _Waiter | None = None
        self.sent_bytes = self.sent_payload_bytes = 0  # what this device sent to other stages, and its float32 size
        self.link_free = 0.0  # wall time the emulated outgoing link finishes the sends queued on it
        self.codec_rng = torch.Generator()  # gradients' stochastic rounding (seeded per message in `send`)

    # -- waiting, with the coordinator's abort in mind ---------------------------------------------------

    def _wait(self, work, what: str) -> None:
        """Wait for `work`; under a coordinator, on a waiter thread, so that an abort ends the wait at once (a
        gloo wait cannot be cancelled, and one with a timeout breaks the connection: the waiter is left behind)."""
        try:
            if self.hb is None or work.is_completed():
                work.wait()
                return
            if self.waiter is None:
                self.waiter = _Waiter()
            if not self.waiter.wait(work, self.hb.abort):
                self.waiter = None  # still blocked on the old generation's work: abandoned with it
                raise Aborted(f"{what} abandoned: the coordinator stopped generation {self.gen.number}")
        except RuntimeError as exc:  # gloo: connection closed by a dead peer, or the group timeout
            if isinstance(exc, Aborted):
                raise
            raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None

    def _post(self, op, what: str, *args):
        try:
            return op(*args)
        except RuntimeError as exc:
            raise PeerLost(f"{what} failed: {gloo_message(exc)}") from None

    def _in_thread(self, fn, what: str):
        """Run a blocking set-up call (a process group's rendezvous) so that an abort can leave it behind."""
        out: dict = {}

        def target() -> None:
            try:
                out["value"] = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                out["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if self.hb is not None and self.hb.abort.is_set():
                raise Aborted(f"{what} abandoned: the coordinator stopped generation {self.gen.number}")
        if "error" in out:
            raise PeerLost(f"{what} failed: {gloo_message(out['error'])}")
        return out["value"]

    def _allreduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self._post(group.allreduce, "an all-reduce", [tensor], opts)

    # -- generations --------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        store_timeout = timedelta(seconds=self.opts.timeout_s)
        world = None if cfg.coordinated else cfg.world_size
        self.store = dist.TCPStore(cfg.host, cfg.port, world, cfg.serve_store, timeout=store_timeout)
        if cfg.coordinated:
            self.hb = Heartbeat(cfg.host, cfg.port, self.name, self.opts.timeout_s)
            self.hb.start()
        number = self.opts.generation
        while True:
            gen = self._await(number) if cfg.coordinated else _static_generation(cfg)
            if gen is None:
                return
            try:
                outcome = self._generation(gen)
            except (PeerLost, Aborted):
                if not cfg.coordinated:
                    raise
                outcome = "lost"
            if outcome in ("done", "left", "out"):
                return
            self._report(gen.number)
            number = gen.number + 1

    def _await(self, number: int) -> Generation | None:
        """Generation `number`'s config from the coordinator, or None when the run ended without it."""
        config, end = gen_key(number, "config"), key("end")
        while True:
            if self.store.check([config]):
                return Generation.from_json(self.store.get(config))
            if self.store.check([end]):
                status = self.store.get(end).decode()
                if status.startswith("failed"):
                    raise PeerLost(f"the coordinator ended the run ({status})")
                return None
            time.sleep(0.05)

    def _report(self, number: int) -> None:
        """Tell the coordinator which copies of which layers this device holds now."""
        copies = []
        if self.live_valid and self.own[1] > self.own[0]:
            copies.append(Copy(self.name, "live", self.live, *self.own))
        for kind, held in (("snapshot", self.snapshot), ("replica", self.replica)):
            if held is not None and held[1]:
                copies.append(Copy(self.name, kind, held[0], min(held[1]), max(held[1]) + 1))
        self.store.set(gen_key(number, "held", self.name), json.dumps([c.__dict__ for c in copies]))

    def _generation(self, gen: Generation) -> str:
        """Train generation `gen`; returns how it ended: done, stopped (at the coordinator's request), left, out."""
        self.gen = gen
        if self.hb is not None:
            self.hb.watch(gen.number)
        if self.name not in gen.ranks:
            return "out"  # the coordinator moved on without this device
        leaving = self.name in gen.leaving
        # Generation 0 of an emulated run calibrates its dilation first (through the store) when no layers
        # cross a link, so that the groups' timeouts know how long a dilated iteration lasts.
        calibrate_first = (
            self.opts.emulate and gen.dilation is None and all(p.local or p.source == CENTRAL for p in gen.pieces)
        )
        started = time.monotonic()
        if not calibrate_first:
            self._make_groups(gen, leaving)
        setup_real_s = time.monotonic() - started
        if gen.dilation is not None or not self.opts.emulate:
            self.clock.dilation = gen.dilation if self.opts.emulate else None
        self._restore(gen)
        if leaving:
            return "left"
        self._take_stage(gen)
        if self.opts.emulate and self.clock.dilation is None:  # generation 0 of an emulated run: calibrate
            self._calibrate(gen)
        if calibrate_first:
            started = time.monotonic()
            self._make_groups(gen, leaving)
            setup_real_s = time.monotonic() - started
        self.emit(
            DeviceStart(
                self.name, self.rank, self.stage, self.clock.dilation, os.getpid(), gen.number, setup_real_s
            ).to_message()
        )
        begin = torch.tensor([now()], dtype=torch.float64)
        self._wait(self._allreduce(begin, self.train, dist.ReduceOp.MAX), "the start-up sync")
        self.last_end = float(begin)
        self.t0 = self._run_start(float(begin))
        for k in range(gen.start, gen.iterations):
            if self._iteration(k):
                return "stopped"
        self._finish()
        return "done"

    def _run_start(self, begin: float) -> float:
        """The run's start (every generation's times count from it): generation 0's start-up sync."""
        if not self.cfg.coordinated:
            return begin
        if self.store.check([key("t0")]):
            return float(self.store.get(key("t0")))
        if self.rank == 0:
            self.store.set(key("t0"), repr(begin))
        return begin

    def _make_groups(self, gen: Generation, leaving: bool) -> None:
        """This generation's groups: everyone in it (restore), the plan's devices (training), and this
        device's stage (all-reduce), each on its own store prefix; the old ones are left alone."""
        timeout = timedelta(
            seconds=group_timeout(self.opts.timeout_s, self.clock.dilation or gen.dilation, gen.longest_wait_s)
        )
        ranks = gen.ranks
        self.ranks = {name: r for r, name in enumerate(ranks)}

        def group(prefix: str, rank: int, size: int):
            store = dist.PrefixStore(gen_key(gen.number, prefix), self.store)
            address = self.cfg.address
            return self._in_thread(lambda: gloo_group(store, rank, size, timeout, address), "forming the groups")

        self.world = group("world", self.ranks[self.name], len(ranks))
        self.abandoned.append(self.world)
        self.train = self.stage_group = None
        if leaving:
            return
        members = gen.plan.device_names
        self.train = self.world if not gen.leaving else group("train", members.index(self.name), len(members))
        for s, st in enumerate(gen.plan.stages):
            names = [x.name for x in st.devices]
            if self.name in names and len(names) > 1:
                self.stage_group = group(f"stage{s}", names.index(self.name), len(names))
        self.abandoned += [self.train, self.stage_group]

    def _take_stage(self, gen: Generation) -> None:
        plan = gen.plan
        self.plan, self.st, self.cluster = plan, gen.steps[self.name], plan.cluster
        self.rank = plan.device_names.index(self.name)
        self.stage = self.st.stage
        self.stage_plan = plan.stages[self.stage]
        self.num_stages = len(plan.stages)
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        x_in, x_out = boundary_examples(self.spec, self.layers, self.stage_plan.start, self.stage_plan.end)
        self.shape_in, self.shape_out = tuple(x_in.shape[1:]), tuple(x_out.shape[1:])
        # Bits per value on the boundary before and after this stage (only float tensors are compressed).
        self.bits_in = plan.level(self.stage - 1) if self.stage and x_in.is_floating_point() else OFF
        self.bits_out = plan.level(self.stage) if x_out.is_floating_point() else OFF
        self.module = torch.nn.Sequential(*self.layers[self.stage_plan.start : self.stage_plan.end])
        self.module.train()
        device = plan.cluster.device(self.name)
        budget = device.memory_bytes if self.opts.emulate and self.opts.enforce_memory else None
        self.memory = MemoryMeter(self.name, budget, self.params, OPTIMIZER_STATES, self._held_bytes())
        self.slow = gen.slow.get(self.name)

    def _held_bytes(self) -> int:
        return sum(layerstate.nbytes(h[1]) for h in (self.snapshot, self.replica) if h is not None)

    def _calibrate(self, gen: Generation) -> None:
        """Agree on the dilation (`stage.calibrated_clock`) through generation 0's store prefix."""
        shape_in = None if self.first else self.shape_in
        store = dist.PrefixStore(gen_key(gen.number), self.store)
        clock = calibrated_clock(
            self.opts.dilation, self.spec, self.module, self.st.samples, shape_in, self.last, self.st.forward_s,
            self.st.backward_s, store, self.rank, len(gen.plan.device_names), self.opts.seed,
        )  # fmt: skip
        self.clock.dilation = clock.dilation

    # -- restore ------------------------------------------------------------------------------------------

    def _states(self, kind: str, start: int, end: int) -> layerstate.LayerStates:
        """Layers [start, end) from this device's copy of `kind`."""
        if kind == "live":
            return layerstate.capture(self.layers, start, end, self.optimizer)
        if kind == SEED:
            if any(start <= k < end for k in self.trained):
                torch.manual_seed(self.opts.seed)
                return layerstate.capture(self.spec.layers(), start, end, None)
            return layerstate.capture(self.layers, start, end, None)
        held = self.snapshot if kind == "snapshot" else self.replica
        return layerstate.select(held[1], start, end)

    def _restore(self, gen: Generation) -> None:
        """Send the pieces others get from this device, receive this device's own, then put them in place."""
        sends = []
        for i, p in enumerate(gen.pieces):
            if p.source == self.name and p.to != self.name:
                data = torch.frombuffer(
                    bytearray(layerstate.to_bytes(self._states(p.kind, p.start, p.end))), dtype=torch.uint8
                )
                size = torch.tensor([data.numel()], dtype=torch.int64)
                dst = self.ranks[p.to]
                sends.append((size, self._post(self.world.send, "sending layers", [size], dst, RESTORE_TAG + 2 * i)))
                sends.append(
                    (data, self._post(self.world.send, "sending layers", [data], dst, RESTORE_TAG + 2 * i + 1))
                )
        got: layerstate.LayerStates = {}
        for i, p in enumerate(gen.pieces):
            if p.to != self.name:
                continue
            start, nbytes = now(), 0
            if p.source == self.name or p.source == SEED:
                states = self._states(p.kind, p.start, p.end)
            elif p.source == CENTRAL:
                data = get_bytes(self.store, gen_key(gen.number, "central", i))
                states, nbytes = layerstate.from_bytes(data), len(data)
            else:
                src = self.ranks[p.source]
                size = torch.zeros(1, dtype=torch.int64)
                self._wait(
                    self._post(self.world.recv, "receiving layers", [size], src, RESTORE_TAG + 2 * i),
                    f"layers from {p.source}",
                )
                data = torch.empty(int(size), dtype=torch.uint8)
                self._wait(
                    self._post(self.world.recv, "receiving layers", [data], src, RESTORE_TAG + 2 * i + 1),
                    f"layers from {p.source}",
                )
                states, nbytes = layerstate.from_bytes(data.numpy().tobytes()), int(size)
            seconds = link_s(gen.plan.cluster, nbytes, self.name) if nbytes else 0.0  # over its own link
            self.clock.pad(start, seconds, compute=False)  # the emulated link: device seconds of the transfer
            got.update(states)
            if gen.number > 0 or p.kind != SEED:
                self.emit(
                    Restore(
                        self.name, p.start, p.end, p.source, p.kind, p.iteration, nbytes, seconds, gen.number
                    ).to_message()
                )
        for _, work in sends:
            self._wait(work, "handing over layers")
        if self.name in gen.leaving:
            return
        self.live_valid = False
        momentum = layerstate.apply(self.layers, got)
        stage = next(st for st in gen.plan.stages if self.name in [s.name for s in st.devices])
        self.own = (stage.start, stage.end)
        self.params = [
            p for layer in self.layers[stage.start : stage.end] for p in layer.parameters() if p.requires_grad
        ]
        self.optimizer = None
        if self.params:
            self.optimizer = torch.optim.SGD(self.params, lr=self.opts.lr, momentum=self.opts.momentum)
            for p in self.params:
                self.optimizer.state[p]["momentum_buffer"] = momentum[p]
        self.live = gen.start
        self.live_valid = True
        if gen.pieces and any(p.kind != SEED for p in gen.pieces if p.to == self.name):
            self.trained.update(range(stage.start, stage.end))

    # -- messages -------------------------------------------------------------------------------------

    def _tag(self, micro_batch: int, kind: str, part: int) -> int:
        return (micro_batch * 2 + (kind == "B")) * 2 + part

    def post_receives(self, backward: bool = True, base: int = 0) -> dict:
        """Post every receive of the iteration now; returns (kind, mb) -> [(transfer, header, payload, works)]."""
        pending = {}
        for mb in range(self.plan.micro_batches):
            for kind, moves, shape in (
                ("F", self.st.recv_forward, self.shape_in),
                ("B", self.st.recv_backward if backward else (), self.shape_out),
            ):
                got = []
                bits = self.bits_in if kind == "F" else gradient_bits(self.bits_out)
                for t in moves:
                    peer = self.ranks[t.peer]
                    header = torch.zeros(1, dtype=torch.float64)
                    if bits < OFF:  # the encoded bytes of the slice (engine.compression)
                        payload = torch.empty(wire_bytes((t.hi - t.lo, *shape), bits), dtype=torch.uint8)
                    else:
                        payload = torch.empty((t.hi - t.lo, *shape))
                    what = f"receiving from {t.peer}"
                    works = [
                        self._post(self.train.recv, what, [header], peer, base + self._tag(mb, kind, 0)),
                        self._post(self.train.recv, what, [payload], peer, base + self._tag(mb, kind, 1)),
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
                self._wait(w, f"{'activations' if kind == 'F' else 'gradients'} from {t.peer}")
            arrival = max(arrival, float(header[0]))
        end = self.clock.wait_until(arrival)
        if end - start > 1e-4:
            self._event("recv", mb, start, end)
        bits, shape = (self.bits_in, self.shape_in) if kind == "F" else (gradient_bits(self.bits_out), self.shape_out)
        parts = [p if bits >= OFF else decode(p, (t.hi - t.lo, *shape), bits) for t, _, p, _ in got]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def send(self, tensor: torch.Tensor, moves, kind: str, mb: int, outbox: list, base: int = 0) -> None:
        """Send each peer its slice without waiting: the sends queue on the device's emulated outgoing link (one
        at a time, each its transfer time), and the device computes on meanwhile, as gloo's sends let it."""
        # activations go to the next stage over the boundary after this one, gradients back over the one before
        bits = self.bits_out if kind == "F" else gradient_bits(self.bits_in)
        for t in moves:
            payload = tensor[t.lo - self.st.lo : t.hi - self.st.lo].detach().contiguous()
            self.sent_payload_bytes += payload.numel() * payload.element_size()
            if bits < OFF:  # gradients are rounded stochastically: unbiased, so SGD still follows the true mean
                # drawn from (seed, stage, iteration, micro-batch, slice) alone: a run repeats exactly, a replay too
                draw = (((self.opts.seed * 1_000_003 + self.stage) * 10_007 + self.iteration) * 1_009 + mb) * 65_537
                draw += t.lo
                self.codec_rng.manual_seed(draw % (1 << 63))
                payload = encode(payload, bits, stochastic=kind == "B", generator=self.codec_rng)
            self.sent_bytes += payload.numel() * payload.element_size()
            # the link carries the real payload: latency + bytes / bandwidth, in device seconds
            seconds = link_s(self.cluster, payload.numel() * payload.element_size(), self.name, t.peer)
            start = max(now(), self.link_free)  # after the sends queued before it
            arrival = start + self.clock.wall(seconds) if self.clock.emulated else 0.0
            self.link_free = arrival
            header = torch.tensor([arrival], dtype=torch.float64)
            peer = self.ranks[t.peer]
            what = f"sending to {t.peer}"
            for part, tensor_part in enumerate((header, payload)):
                work = self._post(self.train.send, what, [tensor_part], peer, base + self._tag(mb, kind, part))
                outbox.append((t.peer, tensor_part, work))  # the tensor stays alive until the send completes
            self._fault(self.iteration, "send")
            self._event("send", mb, start, arrival if self.clock.emulated else now(), peer=t.peer)

    # -- the schedule ---------------------------------------------------------------------------------

    def _event(self, kind: str, mb: int, start: float, end: float, peer: str = "") -> None:
        if self.quiet:
            return
        t0, clock = self.t0, self.clock
        step = StepEvent(
            self.name, self.stage, mb, kind, clock.device(start - t0), clock.device(end - t0), peer, self.iteration,
            self.gen.number,
        )  # fmt: skip
        self.emit(step.to_message())

    def _fault(self, k: int, phase: str) -> None:
        """An injected failure: SIGKILL this process the first time it reaches `phase` of iteration k."""
        for f in self.cfg.fails:
            if f.iteration - 1 == k and f.phase == phase and f not in self.fired:
                self.fired.add(f)
                try:
                    self.store.set(key("fault", self.name), repr(now()))
                finally:
                    os.kill(os.getpid(), signal.SIGKILL)

    def _slice(self, indices: torch.Tensor, mb: int) -> torch.Tensor:
        m = self.plan.micro_batch_size
        return indices[mb * m + self.st.lo : mb * m + self.st.hi]

    def _compute_s(self, seconds: float, k: int) -> float:
        """A step's device seconds, times the injected slow-down from its iteration on."""
        if self.slow and k >= self.slow[0]:
            return seconds * self.slow[1]
        return seconds

    def _iteration(self, k: int) -> bool:
        """Run iteration k (0-based); returns True when the devices agreed to stop at its end."""
        plan, st, clock = self.plan, self.st, self.clock
        self.iteration = k
        indices = batch_indices(len(self.data), plan.batch_size, self.opts.seed, k)
        saved_buffers = layerstate.buffers(self.layers, *self.own)
        try:
            pending = self.post_receives()
            outbox: list = []
            inputs: dict[int, torch.Tensor] = {}
            outputs: dict[int, torch.Tensor] = {}
            loss_sum = 0.0
            m = plan.micro_batch_size
            split = SplitBackward(self.module) if plan.schedule != "1f1b" else None
            for act in stage_actions(plan, self.gen.steps)[self.stage]:
                mb = act.micro_batch
                if act.kind == "F":
                    if self.first:
                        x = load(self.data, self._slice(indices, mb))[0]
                    else:
                        x = self.receive(pending, "F", mb)
                        x.requires_grad_(True)
                    y = load(self.data, self._slice(indices, mb))[1] if self.last else None
                    start = now()
                    with (
                        self.memory.forward(mb),
                        sample_draws(self.opts.seed, k, range(mb * m + st.lo, mb * m + st.hi)),
                    ):
                        out = self.module(x)
                        if self.last:
                            # sum over this device's samples / global batch: the mean-loss gradient of the whole batch
                            out = self.spec.loss(out, y) * (st.samples / plan.batch_size)
                            loss_sum += float(out.detach())
                    inputs[mb], outputs[mb] = x, out
                    self._fault(k, "forward")
                    end = clock.pad(start, self._compute_s(st.forward_s, k))
                    self._event("F", mb, start, end)
                    self.send(out, st.send_forward, "F", mb, outbox)
                elif split is not None:  # a zero-bubble schedule: B sends the input gradient, W comes later
                    self._split_step(act.kind, mb, k, split, pending, inputs, outputs, outbox)
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
                    self._fault(k, "backward")
                    end = clock.pad(start, self._compute_s(st.backward_s, k))
                    self._event("B", mb, start, end)
                    if not self.first:
                        self.send(x.grad, st.send_backward, "B", mb, outbox)
            for peer, _, work in outbox:
                self._wait(work, f"delivery to {peer}")
            clock.wait_until(self.link_free)  # the link is the all-reduce's too: the sends go first
            self._reduce_gradients(k)
            stop = self._agree(k, loss_sum)
        except (PeerLost, Aborted):
            for b, copy in saved_buffers:  # batch-norm statistics as the iteration found them
                b.copy_(copy)
            for p in self.params:
                p.grad = None
            raise
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.live = k + 1
        self.trained.update(range(*self.own))
        E = self.opts.eval_every
        if E and ((k + 1) % E == 0 or k + 1 == self.gen.iterations):
            self._evaluate(k)
        K = self.gen.replicate_every
        if K and (k + 1) % K == 0 and k + 1 < self.gen.iterations:
            self._replicate(k + 1)
        return stop

    def _split_step(self, kind: str, mb: int, k: int, split: SplitBackward, pending, inputs, outputs, outbox) -> None:
        """B (the input gradient, sent back at once) or W (the weight gradients) of micro-batch `mb`."""
        st, clock = self.st, self.clock
        if kind == "B":
            grad = None if self.last else self.receive(pending, "B", mb)
            start = now()
            dx = split.input_gradient(mb, outputs.pop(mb), grad, inputs[mb])
            self._fault(k, "backward")
            if self.first:  # its whole backward is W: B only took the gradient in
                return
            end = clock.pad(start, self._compute_s(st.backward_s - st.weight_s, k))
            self._event("B", mb, start, end)
            self.send(dx, st.send_backward, "B", mb, outbox)
        else:
            start = now()
            split.weight_gradient(mb)
            inputs.pop(mb)
            self.memory.release(mb)
            end = clock.pad(start, self._compute_s(st.weight_s, k))
            self._event("W", mb, start, end)

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
                    x = load(data, mine)[0] if self.first else self.receive(pending, "F", mb)
                    start = now()
                    out = self.module(x)
                    if self.last and score is not None:
                        score(out, load(data, mine)[1])
                    self.clock.pad(start, self._compute_s(st.forward_s, k))
                    if not self.last:
                        self.send(out, st.send_forward, "F", mb, outbox, base=EVAL_TAG)
                for peer, _, work in outbox:
                    self._wait(work, f"delivery to {peer}")

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
            hook = _compress_hook(self.plan.allreduce)
            work = _Hooked(self._post(hook, "an all-reduce", self.stage_group, (flat,)))
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

    def _agree(self, k: int, loss_sum: float) -> bool:
        """The end-of-iteration agreement (the commit point): loss, late steps, the stop request, the end time.
        Rank 0 reports the iteration. Returns whether every device stops after this iteration."""
        asked = self.hb is not None and self.hb.stop_at is not None and k >= self.hb.stop_at
        totals = torch.tensor([loss_sum, self.clock.late, self.clock.steps, float(asked)], dtype=torch.float64)
        self._wait(self._allreduce(totals, self.train), "the end-of-iteration sync")
        end = torch.tensor([now()], dtype=torch.float64)
        self._wait(self._allreduce(end, self.train, dist.ReduceOp.MAX), "the end-of-iteration sync")
        end_t = float(end)
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
                ).to_message()
            )
        return bool(totals[3] > 0)

    def _replicate(self, t: int) -> None:
        """Replication point (t iterations done): snapshot the own layers; each stage's first device copies
        them to the next stage's first device and to the coordinator; the device time is charged."""
        start = now()
        self.snapshot = (t, layerstate.capture(self.layers, *self.own, self.optimizer))
        sender = self.st.lo == 0
        target = neighbour(self.plan, self.stage) if sender else None
        source = None
        if len(self.plan.stages) > 1:
            prev = self.plan.stages[(self.stage - 1) % len(self.plan.stages)]
            source = (
                prev.devices[0].name
                if neighbour(self.plan, (self.stage - 1) % len(self.plan.stages)) == self.name
                else None
            )
        works, seconds = [], 0.0
        if sender:
            data = layerstate.to_bytes(self.snapshot[1])
            seconds = link_s(self.cluster, len(data), self.name)
            if target is not None:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                dst = self.ranks[target]
                works += [(size, self._post(self.train.send, "the replica", [size], dst, REPLICA_TAG))]
                works += [(payload, self._post(self.train.send, "the replica", [payload], dst, REPLICA_TAG + 1))]
            self._fault(t - 1, "replica")
            put_bytes(self.store, key("central", t, f"{self.own[0]}-{self.own[1]}"), data)
            seconds += link_s(self.cluster, len(data), self.name)
        if source is not None:
            src = self.ranks[source]
            size = torch.zeros(1, dtype=torch.int64)
            self._wait(
                self._post(self.train.recv, "the replica", [size], src, REPLICA_TAG), f"the replica from {source}"
            )
            payload = torch.empty(int(size), dtype=torch.uint8)
            self._wait(
                self._post(self.train.recv, "the replica", [payload], src, REPLICA_TAG + 1),
                f"the replica from {source}",
            )
            self.replica = (t, layerstate.from_bytes(payload.numpy().tobytes()))
            seconds = max(seconds, link_s(self.cluster, int(size), self.name, source))
        for _, work in works:
            self._wait(work, f"the replica to {target}")
        self.memory.static_extra(self._held_bytes())
        end = self.clock.pad(start, seconds, compute=False)
        self._event("send", -1, start, end, peer="replica")

    def _finish(self) -> None:
        if self.cfg.coordinated:  # said first: handing the part over (an upload on a slow link) is not a silence
            self.store.set(key("done", self.name), str(self.gen.number))
        part = b""
        if self.opts.save_model and self.st.lo == 0:  # the first device of each stage saves the stage's layers
            buf = io.BytesIO()
            torch.save(part_state_dict(self.module, self.stage_plan.start), buf)
            part = buf.getvalue()
        clock = self.clock
        self.emit(
            DeviceDone(
                self.name,
                clock.late,
                clock.steps,
                clock.overrun_s,
                self.memory.peak,
                state_dict=part,
                wire_bytes=self.sent_bytes,
                payload_bytes=self.sent_payload_bytes,
            ).to_message()
        )
        try:
            self._wait(self._post(self.train.barrier, "the final barrier"), "the final barrier")
        except (PeerLost, Aborted):
            if not self.cfg.coordinated:
                raise  # under a coordinator every iteration is already committed: nothing is lost


def run_device(cfg: DeviceConfig, emit: Emit) -> int:
    """Run one device to the end; report a failure as a `device-error` event. Returns an exit status."""
    torch.set_num_threads(1)  # several devices share the host's cores; more threads only contend
    use_time_base(cfg.time_base)
    device = None
    try:
        device = _Device(cfg, emit)
        device.run()
        return 0
    except Exception as exc:  # reported, not raised: the launcher or agent decides what it means
        iteration = device.iteration if device is not None else -1
        if isinstance(exc, dist.DistNetworkError) and device is not None:  # the store's socket ("Broken pipe")
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            exc = PeerLost(f"lost the job's store ({first}): its coordinator stopped, or the network to it failed")
        emit(error_event(cfg.device_name, iteration, exc, (PeerLost, Aborted, dist.DistError)))
        return 1
    finally:
        if device is not None and device.hb is not None:
            device.hb.close()
