"""One device's part of a hybrid-pipeline run: its stage's layers, the plan's schedule over its sample slices,
stage all-reduce, and, under a coordinator, generations: restore, replicate, roll back and replay after a
membership change. The device's concerns live in mixins: waits.py, links.py, backward.py, copies.py,
evaluate.py, allreduce.py, agreement.py (its numeric precision is an object: precision.py); this module holds
its life: generations, iterations and the commit.

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
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import recipe
from engine.data import get_dataset
from engine.errors import UserError
from engine.events import DeviceDone, DeviceStart, StepEvent
from engine.models import get_model
from engine.models.randomness import sample_draws
from engine.plan import OFF
from engine.runtime import layerstate
from engine.runtime.agreement import Agreement
from engine.runtime.allreduce import StageAllReduce
from engine.runtime.backward import SplitBackward, SplitSteps
from engine.runtime.batches import batch_indices, load
from engine.runtime.config import DeviceConfig, static_generation
from engine.runtime.control import Generation, Heartbeat, gen_key, key
from engine.runtime.copies import Copies
from engine.runtime.deltalinks import DeltaLinks
from engine.runtime.emulation import Clock, MemoryMeter, group_timeout, now, use_time_base
from engine.runtime.evaluate import Evaluation
from engine.runtime.faults import Fail
from engine.runtime.links import Links
from engine.runtime.placement import Placement
from engine.runtime.precision import Precision
from engine.runtime.processes import error_event
from engine.runtime.recovery import CENTRAL
from engine.runtime.stage import PeerLost, boundary_examples, calibrated_clock, gloo_group, part_state_dict
from engine.runtime.waits import Aborted, Waiter, Waits
from engine.steps import stage_actions

Emit = Callable[[dict], None]


class _Device(Waits, Links, DeltaLinks, SplitSteps, Copies, Evaluation, StageAllReduce, Agreement):
    """State of one device across the generations of a run; its concerns are in the mixins' modules."""

    def __init__(self, cfg: DeviceConfig, emit: Emit):
        self.cfg, self.opts, self.emit = cfg, cfg.options, emit
        self.name = cfg.device_name
        opts = cfg.options
        self.spec = get_model(cfg.plan.model)
        # every process builds the same full model (the seed's, or `init`'s weights); it trains the layers it owns
        self.layers = self._initial_layers()
        self.trained: set[int] = set()  # layers whose weights are no longer the seed's
        self.data = get_dataset(opts.dataset, self.spec, root=opts.data_dir, size=opts.dataset_size, seed=opts.seed)
        if len(self.data) < cfg.plan.batch_size:
            raise UserError(
                f"dataset {opts.dataset!r} has {len(self.data)} samples, fewer than one batch of {cfg.plan.batch_size}"
            )
        self.test = None  # the held-out split, loaded at the first evaluation
        self.quiet = False  # no step events (an evaluation's steps are not the iteration's)
        self.reporting = True  # this iteration's steps are reported (RunOptions.steps_every_s)
        self.clock = Clock(None)
        self.t0 = 0.0
        self.iteration = -1
        self.times: list[float] = []  # device seconds of each iteration finished in this generation
        self.live = 0  # iterations whose optimizer step the owned layers have applied
        self.own: tuple[int, int] = (0, 0)  # layers [a, b) this device trains
        self.live_valid = True  # false while a restore is half applied
        self.snapshot: tuple[int, layerstate.LayerStates] | None = None  # own layers at the last replication point
        self.replica: tuple[int, layerstate.LayerStates] | None = None  # the previous stage's, same point
        self.optimizer: torch.optim.Optimizer | None = None
        self.clip = 1.0  # what the gradients are multiplied by before the step (the global norm's clipping,
        # fp16's unscaling), or None: the agreement found an overflow and every device skips the step
        self.place = Placement.resolve(opts.device)  # its CPU or its GPU: every tensor of the stage goes through it
        self.place.check_precision(opts.precision)
        self.precision = Precision(opts, self.place.type)  # autocast, the cuts' dtype, fp16's loss scale (run state)
        self.params: list[torch.nn.Parameter] = []
        self.fired: set[Fail] = set()
        self.hb: Heartbeat | None = None
        self.abandoned: list = []  # process groups of ended generations: never reused, never destroyed
        self.memory: MemoryMeter | None = None
        self.waiter: Waiter | None = None
        self.sent_bytes = self.sent_payload_bytes = 0  # what this device sent to other stages, and its float32 size
        self.link_free = 0.0  # wall time the emulated outgoing link finishes the sends queued on it
        self.codec_rng = torch.Generator()  # gradients' stochastic rounding (seeded per message in `send`)

    # -- generations --------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        store_timeout = timedelta(seconds=self.opts.timeout_s)
        world = None if cfg.coordinated else cfg.world_size
        if cfg.serve_store:  # rank 0 of `train --rank`: on the rendezvous address only (TCPStore alone binds all)
            listener = socket.create_server((cfg.host, cfg.port), backlog=512)
            self.store = dist.TCPStore(cfg.host, cfg.port, world, True, timeout=store_timeout,
                                       master_listen_fd=listener.detach())  # fmt: skip
        else:
            self.store = dist.TCPStore(cfg.host, cfg.port, world, False, timeout=store_timeout)
        if cfg.coordinated:
            self.hb = Heartbeat(cfg.host, cfg.port, self.name, self.opts.timeout_s)
            self.hb.start()
        number = self.opts.generation
        while True:
            gen = self._await(number) if cfg.coordinated else static_generation(cfg)
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

    def _generation(self, gen: Generation) -> str:
        """Train generation `gen`; returns how it ended: done, stopped (at the coordinator's request), left, out."""
        self.gen = gen
        self.times = []  # the measured throughput is the current plan's: set against its prediction
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
            self.place.reset_peak()  # (on a GPU) the peak memory is training's, not the calibration's
        if calibrate_first:
            started = time.monotonic()
            self._make_groups(gen, leaving)
            setup_real_s = time.monotonic() - started
        self.emit(
            DeviceStart(
                self.name,
                self.rank,
                self.stage,
                self.clock.dilation,
                os.getpid(),
                gen.number,
                setup_real_s,
                self.place.describe(),
            ).to_message()
        )
        self._take_deltas(gen.start)
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
        self._tie(gen.plan, group)

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
        start, end = self.stage_plan.start, self.stage_plan.end  # (a cut carrying integers is never compressed)
        self.bits_in = plan.level(self.stage - 1) if self.stage and self.spec.compressible(start) else OFF
        self.bits_out = plan.level(self.stage) if end < len(self.layers) and self.spec.compressible(end) else OFF
        self.bits_in = self.bits_in if x_in.is_floating_point() else OFF
        self.bits_out = self.bits_out if x_out.is_floating_point() else OFF
        rounds = lambda b, x: self.spec.compressible(b) and x.is_floating_point()  # noqa: E731 (16-bit may carry it)
        self.precision.cuts(self.stage > 0 and rounds(start, x_in), end < len(self.layers) and rounds(end, x_out))
        self.module = torch.nn.Sequential(*self.layers[self.stage_plan.start : self.stage_plan.end])
        self.module.train()
        device = plan.cluster.device(self.name)
        budget = device.memory_bytes if self.opts.emulate and self.opts.enforce_memory else None
        states = recipe.optimizer_states(self.opts.optimizer, self.opts.momentum)
        weights = [p for layer in self.module for p in layer.parameters()]
        self.memory = MemoryMeter(self.name, budget, weights, self.params, states, self._held_bytes(), self.place)
        self.slow = gen.slow.get(self.name)

    def _calibrate(self, gen: Generation) -> None:
        """Agree on the dilation (`stage.calibrated_clock`) through generation 0's store prefix."""
        shape_in = None if self.first else self.shape_in
        store = dist.PrefixStore(gen_key(gen.number), self.store)
        clock = calibrated_clock(
            self.opts.dilation, self.spec, self.module, self.st.samples, shape_in, self.last, self.st.forward_s,
            self.st.backward_s, store, self.rank, len(gen.plan.device_names), self.opts.seed, self.place,
        )  # fmt: skip
        self.clock.dilation = clock.dilation

    # -- the schedule ---------------------------------------------------------------------------------

    def _event(self, kind: str, mb: int, start: float, end: float, peer: str = "") -> None:
        if self.quiet or not self.reporting:
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
        real_s = self.gen.predicted_iteration_s * (clock.dilation or 1.0)
        self.reporting = self.opts.reports_steps(k, self.gen.start, real_s)
        self.batch = indices = batch_indices(len(self.data), plan.batch_size, self.opts.seed, k)
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
                        x = self.place.load(load(self.data, self._slice(indices, mb))[0])
                    else:
                        x = self.receive(pending, "F", mb)
                        x.requires_grad_(True)
                    y = self.place.load(load(self.data, self._slice(indices, mb))[1]) if self.last else None
                    timer = self.place.timer()
                    with (
                        self.memory.forward(mb),
                        sample_draws(self.opts.seed, k, range(mb * m + st.lo, mb * m + st.hi)),
                        self.precision.autocast(),
                    ):
                        out = self.module(x)
                        if self.last:
                            # sum over this device's samples / global batch: the mean-loss gradient of the whole batch
                            out = self.spec.loss(out, y) * (st.samples / plan.batch_size)
                            loss_sum += float(out.detach())
                            out = self.precision.scaled(out)  # fp16: times the agreed loss scale
                    inputs[mb], outputs[mb] = x, out
                    start = timer.started()  # on a GPU: once its kernels ran, from its CUDA events
                    self._fault(k, "forward")
                    end = clock.pad(start, self._compute_s(st.forward_s, k))
                    self._event("F", mb, start, end)
                    self.send(out, st.send_forward, "F", mb, outbox)
                elif split is not None:  # a zero-bubble schedule: B sends the input gradient, W comes later
                    self._split_step(act, k, split, pending, inputs, outputs, outbox)
                else:
                    grad = None if self.last else self.receive(pending, "B", mb)
                    timer = self.place.timer()
                    out = outputs.pop(mb)
                    with self._finals(act):  # the last backward: its gradients go to the stage's ring as final
                        if out.requires_grad:  # (not where every weight up to here is frozen)
                            out.backward() if self.last else out.backward(grad.to(out.dtype))
                    start = timer.started()
                    x = inputs.pop(mb)
                    self.memory.release(mb)
                    self._fault(k, "backward")
                    end = clock.pad(start, self._compute_s(st.backward_s, k))
                    self._stepped(act, start, end)
                    self._event("B", mb, start, end)
                    if not self.first:
                        self.send(x.grad, st.send_backward, "B", mb, outbox)
            for peer, _, work in outbox:
                self._wait(work, f"delivery to {peer}")
            clock.wait_until(self.link_free)  # the link is the all-reduce's too: the sends go first
            self._reduce_gradients(k)
            self._reduce_ties()
            stop = self._agree(k, loss_sum)
        except (PeerLost, Aborted):
            self._commit_deltas(k, committed=False)
            for b, copy in saved_buffers:  # batch-norm statistics as the iteration found them
                b.copy_(copy)
            for p in self.params:
                p.grad = None
            raise
        self._commit_deltas(k, committed=True)
        recipe.step(self.optimizer, self.params, self.opts, k, self.clip)
        self.live = k + 1
        self.trained.update(range(*self.own))
        E = self.opts.eval_every
        if E and ((k + 1) % E == 0 or k + 1 == self.gen.iterations):
            self._evaluate(k)
        K = self.gen.replicate_every
        if K and (k + 1) % K == 0 and k + 1 < self.gen.iterations:
            self._replicate(k + 1)
        return stop

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
                self.memory.measure(),
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
