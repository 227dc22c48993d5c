"""The coordinator of a run: hosts the store, owns membership, the plan and the central replica, and recovers.

    coordinator = Coordinator(plan, workload, options, faults, emit, run_dir)
    collected = coordinator.run()      # every device's events; raises RunFailed when recovery is impossible

It starts one process per device, publishes generation 0, and then watches: events (an `iteration` event
commits it), process exits, heartbeats, and the triggers of graceful leaves, joins and slow devices. On a lost
device it stops the generation, gathers which copies of which layers the survivors hold, re-plans on them,
rolls back to the newest iteration every layer has a copy of, and publishes the next generation (see
`recovery` and `control`). It keeps the central replica and writes it atomically to the run's directory,
from which `train --resume DIR` continues a run whose coordinator died.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from engine.compression import parse_compression, plan_compression
from engine.costmodel import Workload, link_s, replica_bytes, replication_s, score
from engine.devices import LAYER_OVERHEAD_S, Cluster, Device, get_kind
from engine.errors import UserError
from engine.events import (
    DeviceJoined,
    DeviceLeft,
    DeviceLost,
    Recovered,
    Repartition,
    Replan,
    Replay,
)
from engine.models import get_model
from engine.plan import Plan
from engine.planners import COMPARED, NoFeasiblePlan, Problem
from engine.planners.levels import plan_compressed
from engine.runtime import layerstate
from engine.runtime.control import Generation, gen_key, get_bytes, has_bytes, key, put_bytes
from engine.runtime.detection import POLL_S
from engine.runtime.emulation import group_timeout
from engine.runtime.faults import Faults, Join, Leave
from engine.runtime.options import RunOptions
from engine.runtime.processes import Collector, DeviceProcesses
from engine.runtime.recovery import CENTRAL, Copy, layer_text, restore_pieces, rollback_point, seed_copy
from engine.steps import device_steps
from engine.workloads import PROFILE_BATCH

if TYPE_CHECKING:
    from engine.predictor.adapt import DeviceModel

Emit = Callable[[dict], None]
DRIFT = 0.25  # measured iterations this much slower than predicted ...
DRIFT_ITERATIONS = 3  # ... this many times in a row trigger a re-partition
SLOW = 1.3  # a device whose compute runs this many times its planned time is slow
HANDOVER_S = 120.0  # how long finished devices may take to hand their parts over before the run ends without them


class RunFailed(UserError):
    """A run could not go on; names the device and the iteration (1-based) when one caused it."""

    def __init__(self, message: str, device: str = "", iteration: int = 0):
        super().__init__(message)
        self.device, self.iteration = device, iteration


@dataclass
class _Recovery:
    """A recovery in progress: when the failure happened, what it has cost so far."""

    generation: int
    failed_at: float  # the host's monotonic clock
    interrupted: int  # the iteration in progress (0-based); recovered when it completes again
    detection_real_s: float
    planning_real_s: float
    throughput_before: float
    summary: str
    restore_s: dict[str, float] = field(default_factory=dict)
    setup_real_s: float = 0.0


def with_model_bytes(w: Workload) -> Workload:
    """`w` with its model's real parameter and momentum bytes, what replication and restores send (a workload
    made up for a test may say otherwise)."""
    with torch.device("meta"):  # shapes only: nothing allocated
        layers = get_model(w.model).layers()
    sizes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    return replace(w, param_bytes=sizes, optimizer_bytes=sizes)


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


class Coordinator:
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
    ):
        if options.compression is None:  # kept in run.json, so that a resumed run re-plans with it too
            options = replace(options, compression=plan_compression(plan.compression))
        self.plan, self.w, self.opts, self.faults = plan, workload, options, faults or Faults()
        self.emit = emit or (lambda _: None)
        self.run_dir = run_dir
        self.wb = with_model_bytes(workload)  # for what crosses the links: the copies and the restores
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
        self.recovery: _Recovery | None = None
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
        self.resume = resume
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
                gen = self._generation(0, self.plan, t, pieces)
                central = self._central_pieces(gen)
            else:
                gen = self._generation(0, self.plan, 0, restore_pieces(self.plan, 0, [seed_copy(self.w.num_layers)]))
                central = {}
            self.plans.append({"generation": 0, "plan": self.plan.to_dict(), "reason": "start", "start": gen.start})
            for name in self.plan.device_names:
                self._spawn(name, 0)
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
            if t - last_poll > POLL_S:
                last_poll = t
                self._poll_central()
                self._beat(t)
            dead = self._dead(t)
            if dead:
                self._recover(dead, "lost")
                last_event = time.monotonic()
                continue
            if self._stopped():
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

    def _after_iteration(self, ev: dict) -> None:
        """A recovery ends when the interrupted iteration completes again; a drifting speed re-partitions."""
        r = self.recovery
        gen = self.generation
        if r is not None and ev["iteration"] >= r.interrupted and ev.get("generation") == gen.number:
            replayed = [
                self.iterations[k]["iteration_s"] for k in range(gen.start, ev["iteration"] + 1) if k in self.iterations
            ]
            restore = max(r.restore_s.values(), default=0.0)
            # control plane in real seconds (detection and pause, planning, new groups); data plane in device seconds
            real = r.detection_real_s + r.planning_real_s + r.setup_real_s
            rec = Recovered(
                generation=gen.number, real_s=real, device_s=restore + sum(replayed),
                wall_s=time.monotonic() - r.failed_at,
                detection_real_s=r.detection_real_s, planning_real_s=r.planning_real_s, setup_real_s=r.setup_real_s,
                restore_device_s=restore, replay_device_s=sum(replayed), iterations_lost=0,
                throughput_before=r.throughput_before, throughput_after=ev["throughput"],
                summary=f"{r.summary}; recovered in {real:.1f} s real / {restore + sum(replayed):.2f} s device",
                iteration=ev["iteration"] + 1,
            ).to_message()  # fmt: skip
            self.recoveries.append(rec)
            self.recovery = None
            self.emit(rec)
            return
        # Measured speeds, on every run: a board throttled, overheating or busy with something else is noticed
        # from its step times (an injected --slow is one way to make one), and the job re-partitions on them.
        if ev.get("generation") == gen.number and ev["iteration"] > gen.start:
            predicted = gen.predicted_iteration_s
            if gen.replicate_every and ev["iteration"] % gen.replicate_every == 0:
                predicted += gen.replication_s  # the copies made after the previous iteration end in this one
            self.drift = self.drift + 1 if ev["iteration_s"] > predicted * (1 + DRIFT) else 0
            if self.drift >= DRIFT_ITERATIONS and self.committed < self.opts.iterations - 1:
                speeds = self._measured_speeds(ev["iteration"])
                if speeds:
                    self.speed.update(speeds)
                    self.repartition = Repartition(
                        ev["iteration"] + 1, speeds, ev["iteration_s"], predicted, gen.number, sorted(self.learned)
                    ).to_message()
                    self.store.set(gen_key(gen.number, "stop"), str(ev["iteration"] + 1))
                self.drift = 0

    def _measured_speeds(self, k: int) -> dict[str, float]:
        """Each device's compute in iteration k against its planned compute: the slow ones' factors."""
        gen = self.generation
        busy: dict[str, float] = {}
        by_kind: dict[tuple[str, str], float] = {}
        for e in self.collected.steps:
            if e.iteration == k and e.generation == gen.number and e.kind in ("F", "B", "W"):
                kind = "F" if e.kind == "F" else "B"  # a split backward's two halves (B and W) are its backward
                busy[e.device] = busy.get(e.device, 0.0) + e.end - e.start
                by_kind[e.device, kind] = by_kind.get((e.device, kind), 0.0) + e.end - e.start
        self._learn(by_kind)
        out = {}
        for name, s in gen.steps.items():
            planned = gen.plan.micro_batches * (s.forward_s + s.backward_s) * self.speed.get(name, 1.0)
            if planned > 0 and busy.get(name, 0.0) / planned > SLOW:
                out[name] = round(busy[name] / planned * self.speed.get(name, 1.0), 2)
        return out

    def _learn(self, busy: dict[tuple[str, str], float]) -> None:
        """Continual learning: each probed device's measured forward and backward time per sample of its stage
        refits its latency-predictor correction (engine.predictor.adapt), which the next re-plan uses."""
        gen = self.generation
        for name, s in gen.steps.items():
            probe = self.true_cluster.device(name).probe
            if not probe or (name, "F") not in busy or (name, "B") not in busy:
                continue
            if name not in self.learned:
                from engine.predictor.adapt import DeviceModel  # scikit-learn: only for probed devices

                self.learned[name] = DeviceModel.from_probe(json.loads(probe))
            st, n, m = gen.plan.stages[s.stage], s.hi - s.lo, gen.plan.micro_batches
            overhead = (st.end - st.start) * LAYER_OVERHEAD_S  # per step, whatever its samples
            f, b = ((busy[name, kind] / m - overhead) / n for kind in ("F", "B"))
            if f > 0 and b > 0:
                self.learned[name].update(self.plan.model, st.start, st.end, n, f, b)

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

    # -- recovery -----------------------------------------------------------------------------------------

    def _holdings(self, survivors: list[str], dead: dict[str, str]) -> list[Copy]:
        """The copies every survivor holds (it reports them once its generation stopped); a survivor that does
        not report within the bound is lost too."""
        gen = self.generation
        bound = time.monotonic() + self.detect_s + 3 * (self.dilation or 1.0) * gen.longest_wait_s + 5
        copies: list[Copy] = []
        waiting = list(survivors)
        while waiting and time.monotonic() < bound:
            for name in list(waiting):
                k = gen_key(gen.number, "held", name)
                if self.store.check([k]):
                    copies += [Copy(**c) for c in json.loads(self.store.get(k))]
                    waiting.remove(name)
                elif self.procs.exitcode(name) is not None:
                    dead[name] = self.procs.why(name)
                    waiting.remove(name)
            if waiting:
                ev = self.procs.get(timeout=0.02)
                if ev is not None:
                    self._event(ev)
        for name in waiting:
            dead[name] = "did not answer the coordinator"
        return copies

    def _recover(self, dead: dict[str, str], reason: str) -> None:
        gen = self.generation
        failed_at = min((self._fault_time(n) for n in dead), default=time.monotonic())
        self.store.set(gen_key(gen.number, "abort"), "1")
        for name in dead:
            self.procs.kill_one(name)
        survivors = [n for n in gen.ranks if n not in dead and n not in gen.leaving]
        copies = self._holdings(survivors, dead)
        paused = time.monotonic()  # every survivor has stopped and said what it holds
        survivors = [n for n in survivors if n not in dead]
        interrupted = self.committed
        for name, why in dead.items():
            self.emit(DeviceLost(name, interrupted + 1, why, paused - failed_at, gen.number).to_message())
        throughput = statistics.median(
            [it["throughput"] for it in self.iterations.values() if it.get("generation") == gen.number] or [0.0]
        )
        if not survivors and not self._standby(gen):
            raise self._fail(
                f"every device was lost ({', '.join(f'{n}: {w}' for n, w in dead.items())}); the central replica "
                f"as of iteration {self.central_done} is in {self.run_dir}: continue with --resume {self.run_dir}",
                next(iter(dead)),
                interrupted + 1,
            )
        self.gone.update(dead)
        plan, planning = self._replan(survivors + self._standby(gen), dead)
        copies += [*self._central_copies(), seed_copy(self.w.num_layers)]
        t = rollback_point(self.w.num_layers, copies)
        pieces = restore_pieces(plan, t, copies)
        nxt = self._generation(gen.number + 1, plan, t, pieces, _sources_outside(plan, pieces))
        self._announce(nxt, planning, reason)
        if t < interrupted + 1:
            self.emit(Replay(t + 1, interrupted + 1, nxt.number).to_message())
        names = ", ".join(dead)
        remote: list[list] = []  # [start, end, source, kind], adjacent ranges from the same copy merged
        for a, b, src, kind in sorted({(p.start, p.end, p.source, p.kind) for p in pieces if not p.local}):
            if remote and remote[-1][1] == a and remote[-1][2:] == [src, kind]:
                remote[-1][1] = b
            else:
                remote.append([a, b, src, kind])
        restored = ", ".join(f"{layer_text(a, b)} restored from {src} ({kind})" for a, b, src, kind in remote)
        causes = "; ".join(c.removeprefix("died (").removesuffix(")") for c in dead.values())  # "SIGKILL"
        replayed = f"iteration {t + 1}" if t == interrupted else f"iterations {t + 1}-{interrupted + 1}"
        summary = (
            f"{names} lost during iteration {interrupted + 1} ({causes}): re-planned on "
            f"{len(plan.device_names)} device{'s' if len(plan.device_names) > 1 else ''} in {planning:.1f} s"
            + (f", {restored}" if restored else "")
            + (f", replayed {replayed}" if t < interrupted + 1 else "")
        )
        earlier = self.recovery  # a failure during a recovery: one recovery, from the first failure on
        if earlier is not None:
            failed_at, throughput = earlier.failed_at, earlier.throughput_before
            interrupted = max(interrupted, earlier.interrupted)
            summary = f"{earlier.summary}; then {summary}"
        self.recovery = _Recovery(nxt.number, failed_at, interrupted, paused - failed_at, planning, throughput, summary)
        self.committed = t
        self._start_standby(gen, nxt)
        self._publish(nxt, self._central_pieces(nxt))

    def _standby(self, gen: Generation) -> list[str]:
        """Devices of the cluster outside generation `gen` that may still be planned on (never lost, never left)."""
        return [d.name for d in self.true_cluster.devices if d.name not in gen.ranks and d.name not in self.gone]

    def _start_standby(self, gen: Generation, nxt: Generation) -> None:
        """Start the processes of the devices the next plan takes from the standby ones."""
        for name in nxt.plan.device_names:
            if name not in gen.ranks:
                self._spawn(name, nxt.number)

    def _fault_time(self, name: str) -> float:
        """When the device failed: the injected fault's own note, else its last heartbeat."""
        k = key("fault", name)
        if self.store.check([k]):
            return float(self.store.get(k))
        return self.beats.get(name, (0, time.monotonic()))[1]

    def _replan(self, names: list[str], dead: dict[str, str]) -> tuple[Plan, float]:
        started = time.monotonic()
        cluster = self._cluster(names)
        try:
            method = self.plan.method if self.plan.method in COMPARED else "asteroid"  # hand-made or exhaustive
            # the run's compression: what the user allowed, else its first plan's levels
            levels, auto = parse_compression(self.opts.compression or plan_compression(self.plan.compression))
            problem = Problem(self._planning_workload(), cluster, self.plan.batch_size, allreduce=self.plan.allreduce)
            plan = plan_compressed(method, problem, levels, auto)
        except NoFeasiblePlan:
            plan = None
        if plan is None or not plan.predicted.fits:
            lost = ", ".join(dead) or "the change"
            raise self._fail(
                f"cannot go on after {lost}: the {len(names)} remaining device(s) ({', '.join(names)}) cannot hold "
                f"{self.plan.model} at batch size {self.plan.batch_size}; the central replica as of iteration "
                f"{self.central_done} is in {self.run_dir}",
                next(iter(dead), ""),
                self.committed + 1,
            )
        return plan, time.monotonic() - started

    def _membership_change(self) -> None:
        """An agreed stop at an iteration boundary: graceful leaves, joins, or a re-partition. No rollback."""
        gen = self.generation
        copies = []
        for name in gen.plan.device_names:
            copies += [Copy(**c) for c in json.loads(self.store.get(gen_key(gen.number, "held", name)))]
        # The boundary is where the devices stopped (their live copies say it); the events of the iterations up
        # to it may still be on their way (a site's agents relay them): read them before the next generation.
        boundary = max([c.iteration for c in copies if c.kind == "live"], default=self.committed)
        deadline = time.monotonic() + self.detect_s + 10
        while self.committed < boundary and time.monotonic() < deadline:
            ev = self.procs.get(timeout=0.05)
            if ev is not None:
                self._event(ev)
        self.committed = boundary = max(boundary, self.committed)
        leaving = [
            lv.device for lv in self.pending_leave if lv.iteration <= boundary and lv.device in gen.plan.device_names
        ]
        self.pending_leave = [lv for lv in self.pending_leave if lv.device not in leaving]
        self.gone.update(leaving)
        joining = [j for j in self.pending_join if j.iteration <= boundary]
        self.pending_join = [j for j in self.pending_join if j not in joining]
        names = [n for n in gen.plan.device_names if n not in leaving]
        new = []
        for j in joining:
            if j.device is not None and j.device.name in {d.name for d in self.true_cluster.devices}:
                self.gone.discard(j.device.name)  # a standby or earlier device: planned on again
                continue
            device = j.device or self._new_device(j.kind)
            self.true_cluster = Cluster(
                (*self.true_cluster.devices, device), self.true_cluster.bandwidth_mbps,
                self.true_cluster.latency_ms, self.true_cluster.name,
            )  # fmt: skip
            new.append((device.name, device.kind))
            names.append(device.name)
        standby = self._standby(gen)
        reason = "left" if leaving else "joined" if joining else "repartition" if self.repartition else "left"
        if reason == "repartition":
            self.emit(self.repartition)
        self.repartition = None
        plan, planning = self._replan(names + [n for n in standby if n not in names], {})
        pieces = restore_pieces(plan, boundary, copies)
        leaving = [*leaving, *(n for n in _sources_outside(plan, pieces) if n not in leaving)]
        nxt = self._generation(gen.number + 1, plan, boundary, pieces, leaving)
        for name in leaving:
            self.emit(DeviceLeft(name, boundary, nxt.number).to_message())
        for name, kind in new:
            self.emit(DeviceJoined(name, kind, boundary, nxt.number).to_message())
        self._start_standby(gen, nxt)
        self._announce(nxt, planning, reason)
        self._publish(nxt, {})

    def _announce(self, nxt: Generation, planning_s: float, reason: str) -> None:
        """Report generation `nxt`'s plan (a `replan` event) and keep it in `plans`."""
        plan = nxt.plan
        throughput = plan.predicted.expected_throughput if plan.predicted else 0.0
        self.emit(Replan(nxt.number, plan.to_dict(), planning_s, reason, throughput, nxt.start).to_message())
        self.plans.append({"generation": nxt.number, "plan": plan.to_dict(), "reason": reason, "start": nxt.start})

    def _new_device(self, kind_name: str) -> Device:
        """A device of `kind_name` for `--join`, named after its kind: nano-3 when nano-0..2 exist."""
        kind = get_kind(kind_name)
        short = kind_name.split("-")[-1] if "-" in kind_name else kind_name
        taken = {d.name for d in self.true_cluster.devices}
        n = 0
        while f"{short}-{n}" in taken:
            n += 1
        return Device.of_kind(f"{short}-{n}", kind.key)

    def _ask_stop(self) -> None:
        """Ask the generation's devices to stop at the next iteration boundary (unless a stop is agreed already)."""
        stop = gen_key(self.generation.number, "stop")
        if not self.store.check([stop]):
            self.store.set(stop, str(self.committed))  # devices stop after the iteration in progress (0-based)

    def leave(self, name: str) -> None:
        """A graceful leave asked while the run goes on (an administrator removed the device): at the next
        iteration boundary it hands over its layers and the run goes on without it. Thread-safe."""
        self.requests.put(lambda: self._leave(name))

    def join(self, device: Device) -> None:
        """A device offered to the running job joins at the next iteration boundary. Thread-safe."""
        self.requests.put(lambda: self._join(device))

    def _leave(self, name: str) -> None:
        gen = self.generation
        if name not in gen.plan.device_names:  # a standby device: it is simply never planned on
            self.gone.add(name)
            return
        self.pending_leave.append(Leave(name, self.committed + 1))
        self._ask_stop()

    def _join(self, device: Device) -> None:
        self.pending_join.append(Join(device.kind, self.committed + 1, device))
        self._ask_stop()

    # -- the central replica ------------------------------------------------------------------------------

    def _poll_central(self) -> None:
        """Collect the stages' parts of the central replica; once an iteration is whole, write it to disk."""
        gen = self.generation
        if not gen.replicate_every:
            return
        K = gen.replicate_every
        for t in range(self.central_done + K - self.central_done % K, self.committed + 1, K):
            parts = self.central.setdefault(t, {})
            for st in gen.plan.stages:
                k = key("central", t, f"{st.start}-{st.end}")
                if (st.start, st.end) not in parts and has_bytes(self.store, k):
                    parts[(st.start, st.end)] = layerstate.from_bytes(get_bytes(self.store, k, delete=True))
            covered = sorted(parts)
            if (
                covered
                and covered[0][0] == 0
                and covered[-1][1] == self.w.num_layers
                and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
            ):
                self.central_done = t
                self._persist(t)
                for old in [x for x in self.central if x < t]:
                    del self.central[old]

    def _central_copies(self) -> list[Copy]:
        return [Copy(CENTRAL, CENTRAL, t, a, b) for t, parts in self.central.items() for a, b in parts]

    def _central_pieces(self, gen: Generation) -> dict[int, bytes]:
        out = {}
        for i, p in enumerate(gen.pieces):
            if p.source == CENTRAL:
                states = {}
                for (a, b), part in self.central[p.iteration].items():
                    states.update(layerstate.select(part, max(a, p.start), min(b, p.end)))
                out[i] = layerstate.to_bytes(states)
        return out

    def _write_run(self) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "model": self.plan.model, "method": self.plan.method, "batch_size": self.plan.batch_size,
            "cluster": self.plan.cluster.to_dict(), "options": self.opts.to_dict(), "replicate_every": self.K,
            "allreduce": self.plan.allreduce,
        }  # fmt: skip
        _atomic(self.run_dir / "run.json", json.dumps(doc, indent=2).encode())

    def _persist(self, t: int) -> None:
        if self.run_dir is None:
            return
        states = {}
        for part in self.central[t].values():
            states.update(part)
        buf = layerstate.to_bytes({"iteration": t, "layers": states, "devices": self.generation.plan.device_names})
        _atomic(self.run_dir / "central.pt", buf)

    def _fail(self, message: str, device: str = "", iteration: int = 0) -> RunFailed:
        self.store.set(key("end"), f"failed: {message}")
        return RunFailed(message, device, iteration)


def _sources_outside(plan: Plan, pieces) -> list[str]:
    """Devices the new plan leaves out that still hand over layers: they take part in the restore, then exit."""
    members = set(plan.device_names)
    return sorted({p.source for p in pieces if not p.local and p.source != CENTRAL and p.source not in members})


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_resume(run_dir: Path) -> tuple[dict, dict]:
    """The run document and the central replica of a run directory (for `train --resume`)."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot resume from {run_dir}: no readable run.json ({exc})") from None
    try:
        central = torch.load(run_dir / "central.pt", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UserError(f"cannot resume from {run_dir}: no central replica yet ({exc})") from None
    return doc, central
