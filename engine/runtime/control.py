"""The control plane between a run's coordinator and its devices: store keys, generation configs, heartbeats.

Everything goes through the rendezvous store the coordinator hosts (plain keys under `asteroid/`):

    asteroid/gen<N>/config       JSON: generation N's plan, each device's steps, where to start, what to restore
    asteroid/gen<N>/abort        set by the coordinator: stop generation N now (a device was lost)
    asteroid/gen<N>/stop         an iteration: finish it (or the current one, if later) and stop at its boundary
    asteroid/gen<N>/held/<dev>   JSON: the copies a device holds after generation N ended (see recovery.Copy)
    asteroid/gen<N>/central/<i>  bytes of restore piece i, from the coordinator's central replica
    asteroid/central/<t>/<a>-<b> bytes of layers [a, b) as of iteration t, a device's part of the central replica
    asteroid/hb/<dev>            heartbeat counter, bumped by each device's heartbeat thread
    asteroid/done/<dev>          set by a device that trained every iteration, before it hands its part over: from
                                 then on its silence is an ending, never a loss
    asteroid/fault/<dev>         when an injected fault fired (the host's monotonic clock)
    asteroid/end                 the run is over ("completed" or "failed: why"): waiting devices exit
Values are JSON or raw bytes (never pickles: a store is reachable by whoever reaches its port).
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch.distributed as dist

from engine.buckets import Bucket
from engine.plan import Plan
from engine.runtime.detection import HEARTBEAT_S
from engine.runtime.recovery import Piece
from engine.steps import DeviceSteps, Transfer

ROOT = "asteroid"


def key(*parts: object) -> str:
    return "/".join([ROOT, *map(str, parts)])


def gen_key(generation: int, *parts: object) -> str:
    return key(f"gen{generation}", *parts)


@dataclass(frozen=True)
class Generation:
    """What every device of generation `number` needs: the plan, its steps, where training starts, and
    which pieces of which layers each device gets from where before it starts."""

    number: int
    plan: Plan
    steps: dict[str, DeviceSteps]
    start: int  # completed iterations the restored state is as of: training resumes at this 0-based index
    iterations: int  # the run's total
    pieces: tuple[Piece, ...]
    predicted_iteration_s: float
    replicate_every: int  # 0: no replication
    dilation: float | None  # None: calibrate (generation 0 only) or a real device
    leaving: tuple[str, ...] = ()  # devices that hand over their layers in this generation and then exit
    slow: dict[str, list] = field(default_factory=dict)  # device -> [from iteration (0-based), factor]
    replication_s: float = 0.0  # device seconds a replication point adds to its iteration
    restore_s: float = 0.0  # device seconds the longest restore of this generation's layers takes

    @property
    def longest_wait_s(self) -> float:
        """Device seconds a healthy device may wait for a peer, at most: the longest iteration (one with a
        replication point) or a peer's restore of its layers, whichever is longer."""
        return max(self.predicted_iteration_s + self.replication_s, self.restore_s)

    @property
    def ranks(self) -> list[str]:
        """Everyone in this generation's world group: the plan's devices, then those leaving."""
        return [*self.plan.device_names, *self.leaving]

    def to_json(self) -> str:
        return json.dumps(
            {
                "number": self.number,
                "plan": self.plan.to_dict(),
                "steps": {name: asdict(s) for name, s in self.steps.items()},
                "start": self.start,
                "iterations": self.iterations,
                "pieces": [p.to_dict() for p in self.pieces],
                "predicted_iteration_s": self.predicted_iteration_s,
                "replicate_every": self.replicate_every,
                "dilation": self.dilation,
                "leaving": list(self.leaving),
                "slow": self.slow,
                "replication_s": self.replication_s,
                "restore_s": self.restore_s,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        doc = json.loads(text)
        steps = {}
        for name, s in doc["steps"].items():
            moves = {k: tuple(Transfer(**t) for t in s[k]) for k in _MOVES}
            buckets = tuple(Bucket(**b) for b in s.get("buckets", ()))
            steps[name] = DeviceSteps(**{**s, **moves, "buckets": buckets})
        return cls(
            number=doc["number"],
            plan=Plan.from_dict(doc["plan"], keep_prediction=True),
            steps=steps,
            start=doc["start"],
            iterations=doc["iterations"],
            pieces=tuple(Piece.from_dict(p) for p in doc["pieces"]),
            predicted_iteration_s=doc["predicted_iteration_s"],
            replicate_every=doc["replicate_every"],
            dilation=doc["dilation"],
            leaving=tuple(doc["leaving"]),
            slow=doc["slow"],
            replication_s=doc["replication_s"],
            restore_s=doc["restore_s"],
        )


CHUNK = 4 << 20  # the store refuses values over 8 MiB: bigger ones travel in chunks


def put_bytes(store, name: str, data: bytes) -> None:
    """Store `data` under `name` in chunks; `name` exists (`has_bytes`) once every chunk is in."""
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        store.set(f"{name}/{i}", chunk)
    store.set(name, str(len(chunks)))


def has_bytes(store, name: str) -> bool:
    return store.check([name])


def get_bytes(store, name: str, delete: bool = False) -> bytes:
    """The bytes `put_bytes` stored (waiting for them); `delete` frees the store's copy."""
    n = int(store.get(name))
    data = b"".join(store.get(f"{name}/{i}") for i in range(n))
    if delete:
        for i in range(n):
            store.delete_key(f"{name}/{i}")
        store.delete_key(name)
    return data


_MOVES = ("send_forward", "send_backward", "recv_forward", "recv_backward")


class Heartbeat:
    """A device's thread: bumps its heartbeat counter and watches the coordinator's abort and stop flags for
    the current generation, on a store connection of its own, so a long step never makes a healthy device
    look dead and a device blocked on data still hears the coordinator."""

    def __init__(self, host: str, port: int, name: str, timeout_s: float):
        self._store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
        self.name = name
        self.generation = -1
        self.abort = threading.Event()
        self.stop_at: int | None = None  # the coordinator asked to stop after this iteration (0-based)
        self._lock = threading.Lock()  # a flag read for one generation is never kept once `watch` moved on
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, generation: int) -> None:
        """Follow the flags of `generation` from now on."""
        with self._lock:
            self.generation, self.stop_at = generation, None
            self.abort.clear()

    def _run(self) -> None:
        beat = key("hb", self.name)
        while not self._quit.wait(HEARTBEAT_S):
            try:
                self._store.add(beat, 1)
                g = self.generation
                if g >= 0:
                    abort = self._store.check([gen_key(g, "abort")])
                    stop = None
                    if self.stop_at is None and self._store.check([gen_key(g, "stop")]):
                        stop = int(self._store.get(gen_key(g, "stop")))
                    # Read for generation g: kept only if the device still runs g (a stop of the generation just
                    # ended, kept into the next, stopped that one after its first iteration with no stop asked).
                    with self._lock:
                        if g == self.generation:
                            if abort:
                                self.abort.set()
                            if stop is not None and self.stop_at is None:
                                self.stop_at = stop
            except Exception:  # the coordinator is gone: the device's own waits will notice
                self.abort.set()
                return

    def close(self) -> None:
        self._quit.set()
