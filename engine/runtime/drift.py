"""After each committed iteration: the end of a recovery, and speed drift, which re-partitions the pipeline
(each device's measured compute against its planned compute; the latency predictor's continual learning)."""

from __future__ import annotations

import json
import time

from engine.devices import LAYER_OVERHEAD_S
from engine.events import Recovered, Repartition
from engine.runtime.control import gen_key

DRIFT = 0.25  # measured iterations this much slower than predicted ...
DRIFT_ITERATIONS = 3  # ... this many times in a row trigger a re-partition
SLOW = 1.3  # a device whose compute runs this many times its planned time is slow


class Drift:
    """Mixin of the coordinator (engine.runtime.coordinator). Needs `recovery`, `generation`, `iterations`,
    `collected`, `speed`, `learned`, `store`, `true_cluster`, `plan`, `opts`, `fleet` and `emit`."""

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
        # Measured speeds: a board throttled, overheating or busy with something else is noticed from its step
        # times (an injected --slow is one way to make one), and the job re-partitions on them. Not in a local run
        # at this host's own speed (`train` without --emulate): its step times are this host's, not the boards'.
        measures_boards = self.opts.emulate or self.fleet is not None
        if measures_boards and ev.get("generation") == gen.number and ev["iteration"] > gen.start:
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
        """Each device's compute in iteration k (or the last before it whose steps were reported) against its
        planned compute: the slow ones' factors."""
        gen = self.generation
        busy: dict[str, float] = {}
        by_kind: dict[tuple[str, str], float] = {}
        computed = [e for e in self.collected.steps if e.generation == gen.number and e.kind in ("F", "B", "W")]
        k = max((e.iteration for e in computed if e.iteration <= k), default=k)  # the last one reported (steps_every_s)
        for e in computed:
            if e.iteration == k:
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
