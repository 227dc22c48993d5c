"""The plan: stages of device groups with per-device micro-batch shares, as dataclasses and plan JSON."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.devices import Cluster, in_limits
from engine.errors import UserError, known_fields
from engine.schedule import SCHEDULES

OFF = 32  # the level of an uncompressed boundary (float32); engine.compression has the codec
LEVELS = (8, 4, 2)
GRADIENT_MIN_BITS = 8  # gradients tolerate fewer lost bits than activations: they cross at >= 8 bits


# The stage's gradient all-reduce: float32 ("off"), or sent as 16-bit floats through torch's DDP communication
# hooks (fp16_compress_hook / bf16_compress_hook), halving the bytes. Bytes per gradient value on the wire:
ALLREDUCE = {"off": 4, "fp16": 2, "bf16": 2}


# The fields of a plan file: what Plan.to_dict writes
PLAN_FIELDS = ("method", "model", "batch_size", "micro_batches", "bandwidth_mbps", "stages", "cluster", "compression",
               "delta_samples", "allreduce", "schedule", "predicted")  # fmt: skip
# Who made a plan: a planner of engine.planners.PLANNERS, "hand" (written by hand, the tests' plans), or a rival
# runtime's own plan (engine.runtime.rivals: "ddp", "pipelining").
METHODS = ("asteroid", "dp", "gpipe", "pipedream", "ftpipehd", "exhaustive", "hand", "ddp", "pipelining")


def gradient_bits(level: int) -> int:
    """Bits per value of the gradients sent back over a boundary whose activations cross at `level`."""
    return max(level, GRADIENT_MIN_BITS)


@dataclass(frozen=True)
class Share:
    """One device of a stage and how many samples of each micro-batch it computes."""

    name: str
    samples: int


@dataclass(frozen=True)
class Stage:
    """Layers [start, end) of the model, run data-parallel by `devices`."""

    start: int
    end: int
    devices: tuple[Share, ...]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.devices)


@dataclass(frozen=True)
class Prediction:
    """What the cost model says a plan will do: `iteration_s` by its closed form (what the planners search
    on), and `simulated_s`, where the plan was simulated (engine.simulator), by the event-driven 1F1B
    iteration, which follows the runtime more closely (`expected_s` is the better of the two that is known)."""

    iteration_s: float
    throughput: float
    bubble_fraction: float
    memory_bytes: dict[str, int]
    fits: bool
    simulated_s: float | None = None

    @property
    def expected_s(self) -> float:
        """The iteration time to expect: the simulated one when known, else the closed form's."""
        return self.simulated_s if self.simulated_s is not None else self.iteration_s

    @property
    def expected_throughput(self) -> float:
        """Samples per second at `expected_s`."""
        if self.simulated_s is None:
            return self.throughput
        return self.throughput * self.iteration_s / self.simulated_s

    def over_memory(self, cluster: Cluster) -> list[str]:
        """The devices whose predicted bytes are more than they have."""
        return [n for n, b in self.memory_bytes.items() if b > cluster.device(n).memory_bytes]

    def to_dict(self) -> dict:
        return {
            "iteration_s": self.iteration_s,
            "throughput": self.throughput,
            "bubble_fraction": self.bubble_fraction,
            "memory_bytes": dict(self.memory_bytes),
            "fits": self.fits,
            **({"simulated_s": self.simulated_s} if self.simulated_s is not None else {}),
        }

    @classmethod
    def from_dict(cls, doc: object) -> Prediction:
        """Parse a plan's `predicted` block (as `to_dict` writes it); every mistake names the field."""
        if not isinstance(doc, dict):
            raise UserError("plan: field 'predicted' must be an object")

        def number(key: str) -> float:
            value = doc.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"plan: predicted.{key} must be a number, got {value!r}")
            return float(value)

        iteration_s, throughput, bubble = number("iteration_s"), number("throughput"), number("bubble_fraction")
        memory = doc.get("memory_bytes")
        if not isinstance(memory, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in memory.values()
        ):
            raise UserError("plan: predicted.memory_bytes must map device names to numbers of bytes")
        fits = doc.get("fits")
        if not isinstance(fits, bool):
            raise UserError(f"plan: predicted.fits must be true or false, got {fits!r}")
        simulated = number("simulated_s") if "simulated_s" in doc else None
        return cls(iteration_s, throughput, bubble, dict(memory), fits, simulated)


@dataclass(frozen=True)
class Plan:
    """A hybrid-pipeline plan for one model, batch size and cluster (the plan JSON of docs/planning.md)."""

    method: str
    model: str
    batch_size: int
    micro_batches: int
    stages: tuple[Stage, ...]
    cluster: Cluster
    predicted: Prediction | None = field(default=None, compare=False)
    # Bits per value sent across each stage boundary (activations forward, their gradients back): 8, 4 or 2,
    # or OFF (32: float32, uncompressed). Empty: every boundary uncompressed.
    compression: tuple[int, ...] = ()
    allreduce: str = "off"  # the stage all-reduce's wire format: a key of ALLREDUCE
    schedule: str = "1f1b"  # the pipeline schedule every stage runs: one of engine.schedule.SCHEDULES
    # Compressed boundaries send a sample seen before as the change of its activation (engine.deltas); each pair
    # of devices across a boundary keeps at most this many samples for it. 0: every sample crosses directly.
    delta_samples: int = 0

    def level(self, boundary: int) -> int:
        """The compression level of the boundary after stage `boundary`."""
        return self.compression[boundary] if 0 <= boundary < len(self.compression) else OFF

    @property
    def compressed(self) -> bool:
        return any(b < OFF for b in self.compression)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def device_names(self) -> list[str]:
        return [s.name for st in self.stages for s in st.devices]

    def validate(self, num_layers: int) -> None:
        """Raise UserError unless the plan is well formed for a model of `num_layers` layers."""
        if self.micro_batches < 1 or self.batch_size % self.micro_batches:
            raise UserError(
                f"plan: batch_size {self.batch_size} is not divisible into {self.micro_batches} micro-batches"
            )
        if not self.stages:
            raise UserError("plan: needs at least one stage")
        expect = 0
        for k, st in enumerate(self.stages):
            if st.start != expect or st.end <= st.start:
                raise UserError(
                    f"plan: stages[{k}].layers {[st.start, st.end]} must start at {expect} and be non-empty; "
                    "stages must cover the layers in order"
                )
            expect = st.end
            if not st.devices:
                raise UserError(f"plan: stages[{k}] has no devices")
            if st.samples != self.micro_batch_size:
                raise UserError(
                    f"plan: stages[{k}] shares sum to {st.samples}, but a micro-batch has "
                    f"{self.micro_batch_size} samples ({self.batch_size}/{self.micro_batches})"
                )
            for s in st.devices:
                if s.samples < 1:
                    raise UserError(f"plan: stages[{k}] device {s.name!r} needs at least 1 sample, has {s.samples}")
                self.cluster.device(s.name)
        if expect != num_layers:
            raise UserError(f"plan: stages cover layers [0, {expect}) but model {self.model!r} has {num_layers}")
        if self.compression and len(self.compression) != len(self.stages) - 1:
            raise UserError(
                f"plan: compression has {len(self.compression)} level(s) but {len(self.stages)} stages have "
                f"{len(self.stages) - 1} boundaries"
            )
        bad = [b for b in self.compression if b not in (OFF, *LEVELS)]
        if bad:
            raise UserError(f'plan: compression levels must be "off", 8, 4 or 2, got {bad[0]!r}')
        if not isinstance(self.allreduce, str) or self.allreduce not in ALLREDUCE:
            raise UserError(f"plan: allreduce must be one of {', '.join(ALLREDUCE)}, got {self.allreduce!r}")
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise UserError(f"plan: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if type(self.delta_samples) is not int or self.delta_samples < 0:
            raise UserError(f"plan: delta_samples must be a whole number >= 0, got {self.delta_samples!r:.40}")
        names = self.device_names
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"plan: device(s) {', '.join(dupes)} appear in more than one place")

    def with_prediction(self, predicted: Prediction) -> Plan:
        return replace(self, predicted=predicted)

    def with_compression(self, levels: tuple[int, ...]) -> Plan:
        """This plan with these per-boundary levels (no prediction: re-score it)."""
        return replace(self, compression=tuple(levels) if any(b < OFF for b in levels) else (), predicted=None)

    def with_delta(self, samples: int) -> Plan:
        """This plan keeping up to `samples` samples per pair across its compressed boundaries (no prediction)."""
        return replace(self, delta_samples=samples if self.compressed else 0, predicted=None)

    @property
    def delta(self) -> bool:
        """Whether its compressed boundaries send changes of activations (engine.deltas)."""
        return self.compressed and self.delta_samples > 0

    def with_schedule(self, name: str) -> Plan:
        """This plan run under schedule `name` (no prediction: re-score it)."""
        return replace(self, schedule=name, predicted=None)

    def to_dict(self) -> dict:
        doc = {
            "method": self.method,
            "model": self.model,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "bandwidth_mbps": self.cluster.bandwidth_mbps,
            "stages": [
                {"layers": [st.start, st.end], "devices": [{"name": s.name, "samples": s.samples} for s in st.devices]}
                for st in self.stages
            ],
            "cluster": self.cluster.to_dict(),
        }
        if self.compressed:
            doc["compression"] = ["off" if b >= OFF else b for b in self.compression]
        if self.delta:
            doc["delta_samples"] = self.delta_samples
        if self.allreduce != "off":
            doc["allreduce"] = self.allreduce
        if self.schedule != "1f1b":
            doc["schedule"] = self.schedule
        if self.predicted is not None:
            doc["predicted"] = self.predicted.to_dict()
        return doc

    @classmethod
    def from_dict(cls, doc: object, keep_prediction: bool = False) -> Plan:
        """Parse plan JSON; every mistake names the field. The `predicted` block is ignored (re-scored) unless
        `keep_prediction`: the web app shows the prediction its planner stored with the plan."""
        if not isinstance(doc, dict):
            raise UserError("plan: top level must be a JSON object")
        known_fields(doc, PLAN_FIELDS, "plan")

        def need(key: str, kind: type | tuple[type, ...]):
            if key not in doc:
                raise UserError(f"plan: missing field {key!r}")
            value = doc[key]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise UserError(f"plan: field {key!r} has the wrong type ({type(value).__name__})")
            return value

        cluster = Cluster.from_dict(need("cluster", dict), name="plan")
        if "bandwidth_mbps" in doc:
            bw = need("bandwidth_mbps", (int, float))
            cluster = cluster.with_bandwidth(in_limits("plan: bandwidth_mbps", "bandwidth_mbps", bw))
        stages = []
        for k, st in enumerate(need("stages", list)):
            if not isinstance(st, dict):
                raise UserError(f"plan: stages[{k}] must be an object with 'layers' and 'devices'")
            known_fields(st, ("layers", "devices"), f"plan: stages[{k}]")
            layers = st.get("layers")
            if not (isinstance(layers, list) and len(layers) == 2 and all(type(x) is int for x in layers)):
                raise UserError(f"plan: stages[{k}].layers must be [start, end] integers")
            devs = st.get("devices")
            if not isinstance(devs, list):
                raise UserError(f"plan: stages[{k}].devices must be a list")
            shares = []
            for d, dev in enumerate(devs):
                if not (isinstance(dev, dict) and isinstance(dev.get("name"), str) and type(dev.get("samples")) is int):
                    raise UserError(f'plan: stages[{k}].devices[{d}] must be {{"name": str, "samples": int}}')
                known_fields(dev, ("name", "samples"), f"plan: stages[{k}].devices[{d}]")
                shares.append(Share(dev["name"], dev["samples"]))
            stages.append(Stage(layers[0], layers[1], tuple(shares)))
        batch_size = need("batch_size", int)
        micro_batches = need("micro_batches", int)
        if batch_size < 1 or micro_batches < 1:
            raise UserError("plan: batch_size and micro_batches must be positive")
        predicted = Prediction.from_dict(doc["predicted"]) if keep_prediction and "predicted" in doc else None
        levels = []
        if not isinstance(doc.get("compression", []), list):
            raise UserError("plan: field 'compression' must be a list of levels (\"off\", 8, 4 or 2), one per boundary")
        for k, b in enumerate(doc.get("compression", [])):
            if b == "off":
                b = OFF
            if type(b) is not int or b not in (OFF, *LEVELS):
                raise UserError(f'plan: compression[{k}] must be "off", 8, 4 or 2, got {b!r}')
            levels.append(b)
        compression = tuple(levels) if any(b < OFF for b in levels) else ()
        allreduce = doc.get("allreduce", "off")
        if not isinstance(allreduce, str) or allreduce not in ALLREDUCE:
            raise UserError(f"plan: field 'allreduce' must be one of {', '.join(ALLREDUCE)}, got {allreduce!r:.40}")
        sched = doc.get("schedule", "1f1b")
        if not isinstance(sched, str) or sched not in SCHEDULES:
            raise UserError(f"plan: field 'schedule' must be one of {', '.join(SCHEDULES)}, got {sched!r:.40}")
        delta = doc.get("delta_samples", 0)
        if type(delta) is not int or delta < 0:
            raise UserError(f"plan: field 'delta_samples' must be a whole number >= 0, got {delta!r:.40}")
        method = need("method", str)
        if method not in METHODS:
            raise UserError(f"plan: field 'method' must be one of {', '.join(METHODS)}, got {method!r:.40}")
        return cls(
            method, need("model", str), batch_size, micro_batches, tuple(stages), cluster, predicted,
            compression, allreduce, sched, delta if compression else 0,
        )  # fmt: skip
