"""Membership of a run: recovering from a lost device (what the survivors hold, the re-plan, the rollback), and
graceful leaves and joins, each a new generation."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

from engine.compression import parse_compression, plan_compression
from engine.devices import Cluster, Device, get_kind
from engine.events import DeviceJoined, DeviceLeft, DeviceLost, DeviceStandby, Replan, Replay
from engine.plan import Plan
from engine.planners import COMPARED, NoFeasiblePlan, Problem
from engine.planners.levels import plan_compressed
from engine.runtime.control import Generation, gen_key, key
from engine.runtime.faults import Join, Leave
from engine.runtime.recovery import CENTRAL, Copy, layer_text, restore_pieces, rollback_point, seed_copy


@dataclass
class Recovery:
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


class Membership:
    """Mixin of the coordinator (engine.runtime.coordinator): recovery, re-planning, leaves and joins."""

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
                f"every device was lost ({', '.join(f'{n}: {w}' for n, w in dead.items())}); "
                + self._central_note(resumable=True),
                next(iter(dead)),
                interrupted + 1,
            )
        self.gone.update(dead)
        plan, planning = self._replan(survivors + self._standby(gen), dead)
        copies += [*self._central_copies(), seed_copy(self.w.num_layers)]
        t = rollback_point(self.w.num_layers, copies)
        pieces = restore_pieces(plan, t, copies)
        nxt = self._generation(gen.number + 1, plan, t, pieces, _sources_outside(plan, pieces))
        self._stand_by([n for n in survivors if n in gen.plan.device_names and n not in plan.device_names], t, nxt)
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
        self.recovery = Recovery(nxt.number, failed_at, interrupted, paused - failed_at, planning, throughput, summary)
        self.committed = t
        self._start_standby(gen, nxt)
        self._publish(nxt, self._central_pieces(nxt))

    def _central_note(self, resumable: bool = False) -> str:
        """Where the run's central replica is, and (`resumable`) how to go on from it; the truth when there is
        none yet (no replication point reached, or no run directory): nothing to resume, the run starts again."""
        if self.run_dir is None or not (self.run_dir / "central.pt").is_file():
            return "no central replica was saved yet (no replication point reached): the run must start again"
        note = f"the central replica as of iteration {self.central_done} is in {self.run_dir}"
        return note + (f": continue with --resume {self.run_dir}" if resumable else "")

    def _standby(self, gen: Generation) -> list[str]:
        """Devices of the cluster outside generation `gen`'s plan that may still be planned on (never lost, never
        asked to leave): some never were in a plan, some a re-plan left out (they may be handing over in `gen`)."""
        return [
            d.name for d in self.true_cluster.devices if d.name not in gen.plan.device_names and d.name not in self.gone
        ]

    def _start_standby(self, gen: Generation, nxt: Generation) -> None:
        """Start the processes of the devices the next plan takes that do not train in `gen`: standby ones, and
        ones that only hand over their layers in it (their process exits after that: a new one starts)."""
        for name in nxt.plan.device_names:
            if name not in gen.plan.device_names:
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
            # the run's compression: what the user allowed, else its first plan's levels; changes of activations
            # keep at most as many samples per pair as the first plan did (the training set's size, or less)
            asked = parse_compression(self.opts.compression or plan_compression(self.plan.compression, self.plan.delta))
            problem = Problem(self._planning_workload(), cluster, self.plan.batch_size, allreduce=self.plan.allreduce,
                              schedule=self.opts.schedule, previous=self.generation.plan)  # fmt: skip
            plan = plan_compressed(method, problem, *asked, samples=self.plan.delta_samples or None)
        except NoFeasiblePlan:
            plan = None
        if plan is None or not plan.predicted.fits:
            lost = ", ".join(dead) or "the change"
            raise self._fail(
                f"cannot go on after {lost}: the {len(names)} remaining device(s) ({', '.join(names)}) cannot hold "
                f"{self.plan.model} at batch size {self.plan.batch_size}; " + self._central_note(),
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
        joined: dict[str, str] = {}  # every device asked to join: name -> kind
        for j in joining:
            if j.device is not None and j.device.name in {d.name for d in self.true_cluster.devices}:
                device = self.true_cluster.device(j.device.name)  # one that left, was lost or stood by, back
                self.gone.discard(device.name)
            else:
                device = j.device or self._new_device(j.kind)
                self.true_cluster = Cluster(
                    (*self.true_cluster.devices, device), self.true_cluster.bandwidth_mbps,
                    self.true_cluster.latency_ms, self.true_cluster.name,
                )  # fmt: skip
            joined[device.name] = device.kind
            if device.name not in names:
                names.append(device.name)
        standby = self._standby(gen)
        reason = "left" if leaving else "joined" if joining else "repartition" if self.repartition else "left"
        if reason == "repartition":
            self.emit(self.repartition)
        self.repartition = None
        plan, planning = self._replan(names + [n for n in standby if n not in names], {})
        pieces = restore_pieces(plan, boundary, copies)
        outside = [n for n in _sources_outside(plan, pieces) if n not in leaving]
        nxt = self._generation(gen.number + 1, plan, boundary, pieces, [*leaving, *outside])
        for name in leaving:
            self.emit(DeviceLeft(name, boundary, nxt.number).to_message())
        for name, kind in joined.items():
            if name in plan.device_names:
                self.emit(DeviceJoined(name, kind, boundary, nxt.number).to_message())
        self._stand_by([n for n in names if n not in plan.device_names], boundary, nxt)  # trained, or asked in
        self._start_standby(gen, nxt)
        self._announce(nxt, planning, reason)
        self._publish(nxt, {})

    def _stand_by(self, names: list[str], iteration: int, nxt: Generation) -> None:
        """Report the devices the plan of generation `nxt` leaves out although nobody asked them to leave."""
        for name in names:
            self.emit(DeviceStandby(name, iteration, len(nxt.plan.device_names), nxt.number).to_message())

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


def _sources_outside(plan: Plan, pieces) -> list[str]:
    """Devices the new plan leaves out that still hand over layers: they take part in the restore, then exit."""
    members = set(plan.device_names)
    return sorted({p.source for p in pieces if not p.local and p.source != CENTRAL and p.source not in members})
