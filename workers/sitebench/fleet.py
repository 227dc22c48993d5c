"""The boards of `control`: many agents on one event loop (the real agent's session each), and each job's devices
sending what a training run sends, at the rate its plan predicts."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import threading
import time

from engine.events import DeviceStart, Iteration, StepEvent
from engine.runtime.options import RunOptions
from workers.connection import Connection
from workers.sitebench.agent import BenchAgent, BenchRunner


class TimedConnection(Connection):
    """The agent's session, timing how long the site takes to take in each heartbeat: a clock probe follows it, and
    the site reads a socket's frames in order, noting a heartbeat's agent alive (webapp.devices.liveness) before
    it reads the next, so the probe's reply comes once the heartbeat has been noted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.heartbeat_s: list[float] = []
        self._after_beat: set[float] = set()

    async def _heartbeat(self, ws) -> None:
        t0 = time.monotonic()
        await super()._heartbeat(ws)
        self._probes.append(t0)
        self._after_beat.add(t0)
        await ws.send(json.dumps({"type": "clock", "t0": t0}))

    def _clock_reply(self, msg: dict, t3: float) -> None:
        t0 = msg.get("t0")
        if t0 in self._after_beat:
            self._after_beat.discard(t0)
            self.heartbeat_s.append(t3 - t0)
        super()._clock_reply(msg, t3)


class FleetRunner(BenchRunner):
    """Accepts the one job the benchmark gave its device; every `start` (a later generation after a coordinator
    took the job over) is noted for the job's sender."""

    def __init__(self, outbox):
        super().__init__(outbox)
        self.starts: list[tuple[float, dict]] = []  # (when, the start message)

    def start(self, msg: dict) -> None:
        if msg.get("job") is not None and msg.get("job") == self.accepted and self.job is None:
            return  # a start its coordinator sent again before it heard of the cancel: nothing to run
        super().start(msg)
        self.starts.append((time.monotonic(), msg))


class FleetAgent(BenchAgent):
    def __init__(self, site, credential: str):
        super().__init__(site, credential)
        self.runner = FleetRunner(self.outbox)
        self.connection = TimedConnection(site, credential, self._hello, self.outbox, self.runner)


def steps_per_iteration(plan: dict, name: str) -> list[tuple[int, str]]:
    """(micro-batch, kind) of the steps a device reports per iteration under `plan` (engine/runtime/worker.py):
    forward and backward of each micro-batch (and W under a zero-bubble schedule), a receive and a send per
    neighbouring stage, and the stage's all-reduce when it has several devices."""
    stages = plan["stages"]
    index = next(i for i, st in enumerate(stages) if any(d["name"] == name for d in st["devices"]))
    kinds = ["F", "B"] + (["W"] if plan.get("schedule", "1f1b") != "1f1b" else [])
    kinds += ["recv", "send"] if index > 0 else []
    kinds += ["send", "recv"] if index < len(stages) - 1 else []
    out = [(mb, k) for mb in range(plan["micro_batches"]) for k in kinds]
    return out + ([(-1, "all-reduce")] if len(stages[index]["devices"]) > 1 else [])


class JobSender:
    """One job's devices sending their events, open loop: iteration k's at t0 + k x the plan's predicted
    iteration time, each device its steps (of the iterations the job's steps_every_s reports) and the first one
    the iteration. After a later `start` (another
    coordinators process took the job over) they carry on in that generation, as devices restored from a fresh
    replica do."""

    def __init__(self, job: int, agents: list[FleetAgent]):
        self.job, self.agents = job, agents
        first = agents[0].runner.starts[0][1]
        self.plan, self.every = first["plan"], max(0.01, float(first.get("predicted_iteration_s") or 0.5))
        self.options = RunOptions.from_dict(first["options"])  # its steps_every_s: which iterations' steps go out
        self.sent_iterations: dict[int, float] = {}  # iteration -> when added
        self.sent_steps: dict[tuple, float] = {}  # (device, iteration, micro-batch, kind) -> when added
        self.generation = 0
        self.generations: list[tuple[float, int]] = []  # (when a new generation's start reached every device, gen)
        self.stopped = threading.Event()

    def _generation(self) -> int:
        """The newest generation every device of the job was told to start."""
        return min(max(msg.get("generation", 0) for _, msg in a.runner.starts) for a in self.agents)

    def _stage(self, name: str) -> int:
        return next(i for i, st in enumerate(self.plan["stages"]) if any(d["name"] == name for d in st["devices"]))

    def _say_started(self, generation: int) -> None:
        for rank, agent in enumerate(self.agents):
            event = DeviceStart(agent.name, rank, self._stage(agent.name), pid=os.getpid(), generation=generation)
            agent.outbox.add(self.job, event.to_message())

    async def run(self, until: float) -> None:
        parts = {a.name: steps_per_iteration(self.plan, a.name) for a in self.agents}
        stages = {a.name: self._stage(a.name) for a in self.agents}
        self._say_started(0)
        t0 = time.monotonic()
        for k in itertools.count():
            due = t0 + k * self.every
            if due > until or self.stopped.is_set():
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            generation = self._generation()
            if generation != self.generation:
                self.generation = generation
                self.generations.append((time.monotonic(), generation))
                self._say_started(generation)
            now = time.monotonic()
            reported = self.options.reports_steps(k, 0, self.every)
            for agent in self.agents:
                for mb, kind in parts[agent.name] if reported else ():
                    ev = StepEvent(agent.name, stages[agent.name], mb, kind, 0.0, self.every, iteration=k,
                                   generation=generation)  # fmt: skip
                    agent.outbox.add(self.job, ev.to_message())
                    self.sent_steps[(agent.name, k, mb, kind)] = now
            loss = 2.3 * math.exp(-k / 500)
            event = Iteration(k, loss, self.every, self.plan["batch_size"] / self.every,
                              steps=sum(map(len, parts.values())), time=round(now - t0, 6),
                              generation=generation)  # fmt: skip
            self.agents[0].outbox.add(self.job, event.to_message())
            self.sent_iterations[k] = now
