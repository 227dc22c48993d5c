"""The coordinator of a run: hosts the store, owns membership, the plan and the central replica, and recovers.

    coordinator = Coordinator(plan, workload, options, faults, emit, run_dir)
    collected = coordinator.run()      # every device's events; raises RunFailed when recovery is impossible

It starts one process per device, publishes generation 0, and then watches: events (an `iteration` event
commits it), process exits, heartbeats, and the triggers of graceful leaves, joins and slow devices. On a lost
device it stops the generation, gathers which copies of which layers the survivors hold, re-plans on them,
rolls back to the newest iteration every layer has a copy of, and publishes the next generation (see
`recovery` and `control`). It keeps the central replica and writes it atomically to the run's directory,
from which `train --resume DIR` continues a run whose coordinator died. Its concerns live in mixins:
membership.py (recovery, re-planning, leaves and joins), drift.py (after each iteration: a recovery's end,
speed drift) and central.py (the central replica); this module holds the set-up, the loop and detection.
"""

from __future__ import annotations

import math
import queue
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from engine import recipe
from engine.compression import plan_compression
from engine.costmodel import Workload, link_s, replica_bytes, replication_s, score
from engine.devices import Cluster
from engine.errors import UserError
from engine.events import Diverged
from engine.models import get_model
from engine.plan import Plan
from engine.runtime.central import CentralReplica
from engine.runtime.control import Generation, gen_key, key, put_bytes
from engine.runtime.detection import POLL_S
from engine.runtime.drift import Drift
from engine.runtime.emulation import group_timeout
from engine.runtime.faults import Faults
from engine.runtime.membership import Membership, Recovery
from engine.runtime.options import RunOptions
from engine.runtime.processes import Collector, DeviceProcesses
from engine.runtime.recovery import CENTRAL, Copy, restore_pieces, seed_copy
from engine.steps import device_steps
from engine.workloads import PROFILE_BATCH

if TYPE_CHECKING:
    from engine.predictor.adapt import DeviceModel

Emit = Callable[[dict], None]
HANDOVER_S = 120.0  # how long finished devices may take to hand their parts over before the run ends without them


class RunFailed(UserError):
    """A run could not go on; names the device and the iteration (1-based) when one caused it."""

    def __init__(self, message: str, device: str = "", iteration: int = 0):
        super().__init__(message)
        self.device, self.iteration = device, iteration


def with_model_bytes(w: Workload, options: RunOptions) -> Workload:
    """`w` with its model's real weight and optimizer-state bytes, what replication and restores send (a workload
    made up for a test may say otherwise)."""
    spec = get_model(w.model)
    layers = recipe.model_layers(spec)
    recipe.prepare(spec, layers, options)
    sizes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    return recipe.trained_workload(replace(w, param_bytes=sizes), layers, options)


def replicate_every_default(plan: Plan, w: Workload, budget: float = 0.04) -> int:
    """The replication period that costs at most `budget` of the predicted throughput (the copies are
    costmodel.replication_s), or 0 (no replication) when some device has no room for its copies."""
    if score(plan, w).fits and not score(plan, w, replicate_every=1).fits:
        return 0
    return max(1, math.ceil(replication_s(plan, w) / (budget * score(plan, w).iteration_s)))


def check_replicas_fit(plan: Plan, w: Workload, K: int) -> None:
    """Refuse a replication period whose copies some device of the plan cannot hold."""
    if K <= 0 or not score(plan, w).fits:
        return
    over = score(plan, w, replicate_every=K).over_memory(plan.cluster)
    if over:
        raise UserError(
            f"device {over[0]} has no room for the fault-tolerance copies (its layers' snapshot and its "
            "neighbour's replica): pass --replicate-every 0 to train without them, or use more devices"
        )


class Fleet(Protocol):
    """Where the devices' processes run: `DeviceProcesses` on this host (`train`), or a site's agents."""

    def spawn(self, name: str, target: Callable, cfg) -> None: ...
    def get(self, timeout: float) -> dict | None: ...
    def drain(self) -> Iterator[dict]: ...
    def exitcode(self, name: str) -> int | None: ...
    def why(self, name: str) -> str: ...
    def kill_one(self, name: str) -> None: ...
    def __enter__(self) -> Fleet: ...
    def __exit__(self, *exc) -> None: ...


class Coordinator(Drift, Membership, CentralReplica):
    """One run's coordinator (in `train` it is the launcher process; on the site, its coordinators process)."""

    def __init__(
        self,
        plan: Plan,
        workload: Workload,
        options: RunOptions,
        faults: Faults | None = None,
        emit: Emit | None = None,
        run_dir: Path | None = None,
        replicate_every: int | None = None,
        detect_s: float = 2.0,
        resume: dict | None = None,
        on_pids: Callable[[dict], None] | None = None,
        fleet: Fleet | None = None,
        store_host: str = "127.0.0.1",
        first_generation: int | None = None,
    ):
        if options.compression is None:  # kept in run.json, so that a resumed run re-plans with it too
            options = replace(options, compression=plan_compression(plan.compression, plan.delta))
        workload = recipe.planned(workload, options)  # its optimizer's state, its frozen weights (engine.recipe)
        self.plan, self.w, self.opts, self.faults = plan, workload, options, faults or Faults()
        self.emit = emit or (lambda _: None)
        self.run_dir = run_dir
        self.wb = with_model_bytes(workload, options)  # for what crosses the links: the copies and the restores
        self.K = replicate_every_default(plan, self.wb) if replicate_every is None else replicate_every
        check_replicas_fit(plan, self.wb, self.K)
        self.detect_s = detect_s
        self.true_cluster = plan.cluster  # the devices as they are (kinds); planning may see them slowed
        self.speed: dict[str, float] = {}  # measured slow-down factors the planner takes into account
        self.learned: dict[str, DeviceModel] = {}  # probed devices: their predictor corrections, refined in the run
        self.collected = Collector()
        self.iterations: dict[int, dict] = {}  # by 0-based iteration: the newest generation's report
        self.committed = 0
        self.generation: Generation | None = None
        self.plans: list[dict] = []  # every generation's plan and why it was made
        self.recoveries: list[dict] = []
        self.recovery: Recovery | None = None
        self.central: dict[int, dict] = {}  # iteration -> {(a, b): states} of central pieces received
        self.central_done = 0  # newest iteration the central replica holds every layer of (0: the seed)
        self.beats: dict[str, tuple[int, float]] = {}
        self.done: set[str] = set()  # devices whose device-done event arrived (with their part of the model)
        self.finished: set[str] = set()  # devices that said in the store they trained every iteration
        self.finished_at: float | None = None  # when every device of the generation had finished
        self.gone: set[str] = set()  # devices lost or left: never planned on again
        self.dilation = options.dilation
        self.pending_join = list(self.faults.join)
        self.pending_leave = list(self.faults.leave)
        self.drift = 0
        self.diverged = False  # said once (engine.recipe.divergence)
        self.resume = resume
        # generations are numbered once over a run: a resumed one goes on from its central replica's (or from
        # what the caller counted)
        if first_generation is None:
            first_generation = resume.get("generation", -1) + 1 if resume is not None else 0
        self.first_generation = first_generation
        self.joined = 0
        self.fleet = fleet  # None: one local process per device (`train`); a site passes its agents' fleet
        self.store_host = store_host  # the address the devices reach the store at
        self.repartition: dict | None = None  # the re-partition the generation's agreed stop is for
        self.stop_reason = ""  # set by `stop` (another thread): the run ends, failed with this reason
        self.requests: queue.SimpleQueue = queue.SimpleQueue()  # leaves and joins asked from other threads

    # -- set-up -------------------------------------------------------------------------------------------

    def _start_store(self) -> None:
        timeout = timedelta(seconds=self.opts.timeout_s)
        # Loopback only (TCPStore authenticates no one): devices on other hosts come through the site's store
        # gateway (workers/storelink.py); the devices are told `store_host`. A store on its own would listen on
        # every interface, so it gets a listening socket of ours.
        listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.store_address = listener.getsockname()
        self.store = dist.TCPStore(
            "127.0.0.1", self.store_address[1], None, True, timeout=timeout, wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns (and closes) the socket from now on
        )  # fmt: skip

    def _spawn(self, name: str, generation: int) -> None:
        from engine.runtime.config import DeviceConfig
        from engine.runtime.worker import run_device

        self.beats.pop(name, None)  # a device the plan left out earlier may be started again
        self.done.discard(name)
        self.finished.discard(name)
        self.store.delete_key(key("done", name))
        cfg = DeviceConfig(
            self.plan, None, 0, self.store_host, self.store.port, replace(self.opts, generation=generation),
            predicted_iteration_s=score(self.plan, self.w).iteration_s, coordinated=True, name=name,
            fails=self.faults.fails_of(name),
        )  # fmt: skip
        self.procs.spawn(name, run_device, cfg)

    def _publish(self, gen: Generation, central_pieces: dict[int, bytes]) -> None:
        for i, data in central_pieces.items():
            put_bytes(self.store, gen_key(gen.number, "central", i), data)
        stops = [j.iteration for j in self.pending_join] + [
            lv.iteration for lv in self.pending_leave if lv.device in gen.plan.device_names
        ]
        stops = [s for s in stops if s > gen.start]
        if stops:
            self.store.set(gen_key(gen.number, "stop"), str(min(stops) - 1))
        self.store.set(gen_key(gen.number, "config"), gen.to_json())
        self.generation = gen
        self.gen_started = time.monotonic()
        self.drift = 0

    def _generation(self, number: int, plan: Plan, start: int, pieces, leaving=()) -> Generation:
        pieces = tuple(pieces)
        true_plan = replace(plan, cluster=self._cluster(plan.device_names, slowed=False))
        steps = device_steps(true_plan, self.w)  # the devices' own speeds: a slow one pads by its factor
        slow = {s.device: [s.iteration - 1, s.factor] for s in self.faults.slow if s.device in plan.device_names}
        return Generation(
            number=number, plan=plan, steps=steps, start=start, iterations=self.opts.iterations,
            pieces=pieces, predicted_iteration_s=score(plan, self.w).iteration_s, replicate_every=self.K,
            replication_s=self.replication_s(plan), restore_s=self._restore_s(plan, pieces),
            dilation=self.dilation, leaving=tuple(leaving), slow=slow,
        )  # fmt: skip

    def replication_s(self, plan: Plan) -> float:
        """Device seconds a replication point adds to an iteration of `plan` (0: no replication)."""
        return replication_s(plan, self.wb) if self.K else 0.0

    def _restore_s(self, plan: Plan, pieces) -> float:
        """Device seconds of the longest restore: the layers a device receives over its link, one after the other."""
        per: dict[str, float] = {}
        for p in pieces:
            if not p.local:
                per[p.to] = per.get(p.to, 0.0) + link_s(plan.cluster, replica_bytes(self.wb, p.start, p.end), p.to)
        return max(per.values(), default=0.0)

    def _cluster(self, names: list[str], slowed: bool = True) -> Cluster:
        """The cluster of `names`: as planned (measured slow-downs applied) or as the devices really are."""
        devices = []
        for n in names:
            d = self.true_cluster.device(n)
            factor = self.speed.get(n, 1.0) if slowed else 1.0
            if factor != 1.0:
                d = replace(d, kind="custom", gflops=d.gflops / factor)
            devices.append(d)
        c = self.true_cluster
        return Cluster(tuple(devices), c.bandwidth_mbps, c.latency_ms, c.name)

    def _planning_workload(self) -> Workload:
        """The workload to re-plan with: a device whose per-layer times are known has them scaled by its measured
        slow-down (gflops does it for the others, in `_cluster`); a probed device's are predicted again from its
        correction, refitted on the step times it measured (`_learn`)."""
        tables = {
            name: tuple(tuple(t * self.speed[name] for t in times) for times in self.w.device_times[name])
            for name in self.speed
            if name in self.w.device_times and self.speed[name] != 1.0
        }
        for name, learned in self.learned.items():  # probed devices: the predictor's refitted per-layer times
            tables[name] = tuple(tuple(map(float, times)) for times in learned.predict(self.plan.model, PROFILE_BATCH))
        return self.w.with_device_times(tables) if tables else self.w

    # -- the run ------------------------------------------------------------------------------------------

    def run(self) -> Collector:
        self._start_store()
        self.procs = self.fleet if self.fleet is not None else DeviceProcesses()
        self._write_run()
        with self.procs:
            if self.resume is not None:
                t, states = self.resume["iteration"], self.resume["layers"]
                self.central = {t: {(0, self.w.num_layers): states}}
                self.central_done = t
                self.committed = t
                copies = [Copy(CENTRAL, CENTRAL, t, 0, self.w.num_layers)]
                pieces = restore_pieces(self.plan, t, copies)
                gen = self._generation(self.first_generation, self.plan, t, pieces)
                central = self._central_pieces(gen)
            else:
                seed = restore_pieces(self.plan, 0, [seed_copy(self.w.num_layers)])
                gen = self._generation(self.first_generation, self.plan, 0, seed)
                central = {}
            reason = "start" if gen.number == 0 else "resumed"
            first = {"generation": gen.number, "plan": self.plan.to_dict(), "reason": reason, "start": gen.start}
            self.plans.append(first)
            for name in self.plan.device_names:
                self._spawn(name, gen.number)
            self._publish(gen, central)
            try:
                self._loop()
            finally:
                if not self.store.check([key("end")]):
                    self.store.set(key("end"), "failed: the coordinator stopped")
            for ev in self.procs.drain():
                self._event(ev)
        return self.collected

    def stop(self, reason: str) -> None:
        """End the run from another thread (a cancelled job): the devices are told, `run` raises RunFailed."""
        self.stop_reason = reason

    def _loop(self) -> None:
        last_event = time.monotonic()
        last_poll = 0.0
        while True:
            ev = self.procs.get(timeout=0.05)
            t = time.monotonic()
            if self.stop_reason:
                raise self._fail(self.stop_reason)
            while self.recovery is None and not self.requests.empty():  # after a recovery, not during one
                self.requests.get()()
            if ev is not None:
                last_event = t
                self._event(ev)
            members = self.generation.plan.device_names
            if self.committed >= self.opts.iterations and all(n in self.done for n in members):
                self.store.set(key("end"), "completed")
                return
            if self._handed_over_late(members, t):
                self.store.set(key("end"), "completed")
                return
            polled = t - last_poll > POLL_S  # the store is read at this pace, not once per event
            if polled:
                last_poll = t
                self._poll_central()
                self._beat(t)
            dead = self._dead(t)
            if dead:
                self._recover(dead, "lost")
                last_event = time.monotonic()
                continue
            if polled and self._stopped():
                self._membership_change()
                last_event = time.monotonic()
                continue
            quiet = group_timeout(self.opts.timeout_s, self.dilation, self.generation.longest_wait_s) * 2
            if self.opts.eval_every:  # an evaluation sends no events: at most this many forward-only batches
                batches = max(1, self.opts.eval_samples // self.plan.batch_size)
                quiet += (self.dilation or 1.0) * batches * self.generation.predicted_iteration_s
            if t - last_event > quiet:
                raise self._fail(
                    f"run stalled in iteration {self.committed + 1}: no device reported anything for {quiet:.0f} s"
                )

    def _event(self, ev: dict) -> None:
        kind = ev.get("type")
        ev = self.collected.add(ev) if kind != "iteration" else ev
        if kind in ("iteration", "eval") and not self.diverged:
            self._check_divergence(ev)
        if kind == "iteration":
            k = ev["iteration"]
            self.iterations[k] = ev
            self.committed = (
                max(self.committed, k + 1) if ev.get("generation", 0) == self.generation.number else self.committed
            )
            self._after_iteration(ev)
        elif kind == "device-start":
            self.dilation = self.dilation or ev.get("dilation")
            if self.recovery is not None:
                self.recovery.setup_real_s = max(self.recovery.setup_real_s, ev.get("setup_real_s", 0.0))
        elif kind == "device-done":
            self.done.add(ev["device"])
        elif kind == "restore" and self.recovery is not None:
            r = self.recovery
            r.restore_s[ev["device"]] = r.restore_s.get(ev["device"], 0.0) + ev["device_s"]
        elif kind == "device-error" and ev.get("cause") == "own":
            it = ev["iteration"] + 1 if ev["iteration"] >= 0 else 0
            when = f"in iteration {it}" if it else "while starting"
            self.emit(ev)
            raise self._fail(f"device {ev['device']} failed {when}: {ev['message']}", ev["device"], it)
        self.emit(ev)

    def _check_divergence(self, ev: dict) -> None:
        """Say once that the run diverged (engine.recipe.divergence); end it when the options ask to."""
        why = recipe.divergence(ev, recipe.chance_loss(get_model(self.plan.model)))
        if why is None:
            return
        self.diverged = True
        stop = self.opts.stop_on_divergence
        said = Diverged(ev["iteration"] + 1, why, stop).to_message()
        self.emit(said)
        if stop:
            self.emit(ev)
            message = f"the run diverged at iteration {ev['iteration'] + 1} ({why}) and stopped, as its options ask"
            raise self._fail(message, "", ev["iteration"] + 1)

    # -- detection ----------------------------------------------------------------------------------------

    def _beat(self, t: float) -> None:
        for name in self.generation.ranks:
            count = self.store.add(key("hb", name), 0)
            if name not in self.beats or self.beats[name][0] != count:
                self.beats[name] = (count, t)
            if name not in self.finished and self.store.check([key("done", name)]):
                self.finished.add(name)

    def _handed_over_late(self, members: list[str], t: float) -> bool:
        """Every device trained every iteration, but some part of the model never arrived (its agent died while
        uploading): after HANDOVER_S the run is complete all the same (the site says which part is missing)."""
        if self.committed < self.opts.iterations or not all(n in self.finished for n in members):
            self.finished_at = None
            return False
        self.finished_at = self.finished_at or t
        return t - self.finished_at > HANDOVER_S

    def _dead(self, t: float) -> dict[str, str]:
        """Devices of the current generation that died or went silent: name -> why."""
        dead = {}
        for name in self.generation.ranks:
            code = self.procs.exitcode(name)
            if name in self.done or name in self.finished or code == 0:  # finished (its part may be on its way) or left
                continue
            if code is not None:
                dead[name] = self.procs.why(name)
            elif name in self.beats and self.beats[name][0] > 0 and t - self.beats[name][1] > self.detect_s:
                dead[name] = f"no heartbeat for {t - self.beats[name][1]:.1f} s"
        return dead

    def _stopped(self) -> bool:
        """Every device of the generation reported its copies after an agreed stop (leave, join, re-partition)."""
        gen = self.generation
        if not self.store.check([gen_key(gen.number, "stop")]):
            return False
        return all(self.store.check([gen_key(gen.number, "held", n)]) for n in gen.plan.device_names)

    def _fail(self, message: str, device: str = "", iteration: int = 0) -> RunFailed:
        self.store.set(key("end"), f"failed: {message}")
        return RunFailed(message, device, iteration)
