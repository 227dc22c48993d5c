"""Device kinds, devices and clusters: the hardware a plan is made for, and the cluster file format."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import UserError, known_fields

GIB = 1024**3


@dataclass(frozen=True)
class DeviceKind:
    """A board model. `gflops` is NVIDIA's public FP16 peak; `reserved_gb` is what the OS and CUDA keep."""

    key: str
    label: str
    memory_gb: float
    gflops: float
    reserved_gb: float


# Jetson facts (FP16 peak; docs/planning.md). Memory on the Nano is shared CPU/GPU, so more is reserved.
KINDS: dict[str, DeviceKind] = {
    k.key: k
    for k in (
        DeviceKind("jetson-nano", "Jetson Nano", 4.0, 472.0, 1.2),
        DeviceKind("jetson-tx2", "Jetson TX2", 8.0, 1330.0, 1.5),
        DeviceKind("jetson-xavier-nx", "Jetson Xavier NX", 8.0, 1690.0, 1.5),
    )
}
ALIASES = {"nano": "jetson-nano", "tx2": "jetson-tx2", "nx": "jetson-xavier-nx", "xavier-nx": "jetson-xavier-nx"}
SHORT = {v: k for k, v in ALIASES.items() if k != "xavier-nx"}

# Fraction of FP16 peak a board sustains when training in FP32 (about half the peak is FP32, and
# training kernels reach roughly half of that). Used to turn FLOPs into device seconds.
TRAINING_EFFICIENCY = 0.25
# Fixed cost a device pays per layer per forward or backward pass (kernel launches, Python).
LAYER_OVERHEAD_S = 50e-6

# The numbers a cluster file (and --bandwidth-mbps) may give, (least, most): past them a number is a typo, and
# the planner's arithmetic breaks (memory_gb 1e30 overflows int64 bytes; gflops 1e308 or 1e-15 divides by zero).
# The web forms (webapp/devices/forms.py, webapp/jobs/forms.py) take their maxima from here. The minima sit far
# below any real board, as a plan file's cluster may be a re-plan's: a board slowed down 1000x, a link its agent
# measured.
LIMITS: dict[str, tuple[float, float]] = {
    "memory_gb": (0.0, 1024.0),
    "reserved_gb": (0.0, 1024.0),
    "gflops": (1e-6, 1e6),
    "bandwidth_mbps": (1e-3, 1e6),  # a cluster's, or one board's own link
    "latency_ms": (0.0, 10_000.0),
}


# The fields of a cluster file and of each of its devices: what Cluster.to_dict and Device.to_dict write, no more
CLUSTER_FIELDS = ("name", "bandwidth_mbps", "latency_ms", "devices")
DEVICE_FIELDS = ("name", "kind", "memory_gb", "gflops", "reserved_gb", "bandwidth_mbps", "probe")


def in_limits(what: str, key: str, value: object) -> float:
    """`value` as a float if it is a number within LIMITS[key]; else a UserError naming `what` (the field)."""
    low, high = LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise UserError(f"{what} must be a number from {low:g} to {high:g}, got {repr(value)[:20]}")
    return float(value)


def get_kind(name: str) -> DeviceKind:
    """The kind for a key or alias ("nano", "jetson-tx2", ...)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in KINDS:
        known = ", ".join(sorted(set(KINDS) | set(ALIASES)))
        raise UserError(f"unknown device kind {name!r}; known kinds: {known}")
    return KINDS[key]


@dataclass(frozen=True)
class Device:
    """One device of a cluster: a named board of a kind, or a custom device with its own memory and speed."""

    name: str
    kind: str
    memory_gb: float
    gflops: float
    reserved_gb: float = 0.0
    # A device of no known kind may carry its probe (engine.predictor: a few layers timed on it, as canonical
    # JSON); planning then uses the latency predictor's per-layer times for it instead of gflops.
    probe: str = ""
    # The board's own link to the LAN (its Ethernet port or Wi-Fi), Mbps; None: the cluster's bandwidth. A board on
    # slow Wi-Fi beside wired ones moves its activations, gradients and replicas at its own rate.
    link_mbps: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise UserError("a device needs a non-empty name")
        if self.memory_gb <= self.reserved_gb:
            raise UserError(f"device {self.name!r}: memory_gb {self.memory_gb} must exceed reserved {self.reserved_gb}")
        if self.gflops <= 0:
            raise UserError(f"device {self.name!r}: gflops must be positive, got {self.gflops}")
        if self.link_mbps is not None and not 0 < self.link_mbps < float("inf"):
            raise UserError(f"device {self.name!r}: bandwidth_mbps must be a positive number, got {self.link_mbps}")

    @property
    def memory_bytes(self) -> int:
        """Bytes a training process may use on this device."""
        return int((self.memory_gb - self.reserved_gb) * GIB)

    @property
    def flops_per_s(self) -> float:
        """Sustained training FLOP/s."""
        return self.gflops * 1e9 * TRAINING_EFFICIENCY

    @property
    def spec(self) -> tuple:
        """What makes two devices interchangeable for planning."""
        return (self.kind, self.memory_gb, self.gflops, self.reserved_gb, self.probe, self.link_mbps)

    @classmethod
    def of_kind(cls, name: str, kind: str) -> Device:
        k = get_kind(kind)
        return cls(name, k.key, k.memory_gb, k.gflops, k.reserved_gb)

    def to_dict(self) -> dict:
        if self.kind in KINDS:
            doc = {"name": self.name, "kind": self.kind}
        else:
            doc = {
                "name": self.name,
                "memory_gb": self.memory_gb,
                "gflops": self.gflops,
                "reserved_gb": self.reserved_gb,
            }
        if self.probe:
            doc["probe"] = json.loads(self.probe)
        if self.link_mbps is not None:
            doc["bandwidth_mbps"] = self.link_mbps
        return doc


@dataclass(frozen=True)
class Cluster:
    """Devices on one LAN (a switch): every board's link has the cluster's bandwidth unless the board has its own
    (`Device.link_mbps`); a transfer runs at the slower of its two ends' links, every link has the same latency."""

    devices: tuple[Device, ...]
    bandwidth_mbps: float = 1000.0
    latency_ms: float = 0.2
    name: str = "custom"
    _index: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    _rates: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    @property
    def label(self) -> str:
        """How messages name it: `cluster 'C'`, or for a cluster of no name (the site's devices) "the N devices"."""
        n = len(self.devices)
        return f"cluster {self.name!r}" if self.name else f"the {n} device{'s' if n != 1 else ''} given"

    def __post_init__(self) -> None:
        if not self.devices:
            raise UserError("a cluster needs at least one device")
        names = [d.name for d in self.devices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"duplicate device names in cluster: {', '.join(dupes)}")
        if self.bandwidth_mbps <= 0:
            raise UserError(f"bandwidth_mbps must be positive, got {self.bandwidth_mbps}")
        if self.latency_ms < 0:
            raise UserError(f"latency_ms must be >= 0, got {self.latency_ms}")
        object.__setattr__(self, "_index", {d.name: d for d in self.devices})
        object.__setattr__(self, "_rates", {})  # bytes_per_s_of's answers: the simulator asks again and again

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    def bytes_per_s_of(self, *names: str) -> float:
        """Bytes/s of a transfer between the named devices (or of one device's own link): the slowest of their
        links, a device of no link of its own counting the cluster's bandwidth; with no names, the cluster's."""
        if names not in self._rates:
            self._rates[names] = min((self.link_mbps_of(self.device(n)) for n in names), default=self.bandwidth_mbps)
        return self._rates[names] * 1e6 / 8

    def link_mbps_of(self, device: Device) -> float:
        """A device's own link, Mbps: its `link_mbps`, else the cluster's bandwidth."""
        return self.bandwidth_mbps if device.link_mbps is None else device.link_mbps

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    def device(self, name: str) -> Device:
        try:
            return self._index[name]
        except KeyError:
            raise UserError(f"device {name!r} is not in cluster {self.name!r}") from None

    def with_bandwidth(self, mbps: float) -> Cluster:
        return Cluster(self.devices, mbps, self.latency_ms, self.name)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "bandwidth_mbps": self.bandwidth_mbps,
            "latency_ms": self.latency_ms,
            "devices": [d.to_dict() for d in self.devices],
        }

    @classmethod
    def from_dict(cls, doc: object, name: str = "custom") -> Cluster:
        """Parse a cluster document; every mistake names the field."""
        if not isinstance(doc, dict):
            raise UserError("cluster file: top level must be a JSON object with a 'devices' list")
        known_fields(doc, CLUSTER_FIELDS, "cluster file")
        devices_doc = doc.get("devices")
        if not isinstance(devices_doc, list) or not devices_doc:
            raise UserError("cluster file: 'devices' must be a non-empty list")
        devices = []
        for i, d in enumerate(devices_doc):
            where = f"cluster file: devices[{i}]"
            if not isinstance(d, dict):
                raise UserError(f'{where} must be an object like {{"name": "nano-0", "kind": "jetson-nano"}}')
            known_fields(d, DEVICE_FIELDS, where)
            dev_name = d.get("name")
            if not isinstance(dev_name, str) or not dev_name:
                raise UserError(f"{where}.name must be a non-empty string")
            if "kind" in d and d["kind"] != "custom":
                if not isinstance(d["kind"], str):
                    raise UserError(f"{where}.kind must be a string")
                base = get_kind(d["kind"])
            else:
                base = None
            values = {}
            for key in ("memory_gb", "gflops", "reserved_gb"):
                v = d.get(key, getattr(base, key) if base else (0.0 if key == "reserved_gb" else None))
                if v is None:
                    raise UserError(f"{where}.{key} is required for a custom device (or give a 'kind')")
                values[key] = in_limits(f"{where}.{key} (device {dev_name!r})", key, v)
            kind = base.key if base else "custom"
            if base and (values["memory_gb"], values["gflops"], values["reserved_gb"]) != (
                base.memory_gb,
                base.gflops,
                base.reserved_gb,
            ):
                kind = "custom"
            link = d.get("bandwidth_mbps")
            if link is not None:  # its own link's Mbps
                link = in_limits(f"{where}.bandwidth_mbps (device {dev_name!r})", "bandwidth_mbps", link)
            probe = ""
            if "probe" in d:
                probe = canonical_probe(d["probe"], f"{where}.probe")
                kind = "custom"  # its own measured times, whatever board it is
            devices.append(
                Device(dev_name, kind, values["memory_gb"], values["gflops"], values["reserved_gb"], probe,
                       link)
            )  # fmt: skip
        extra = {k: in_limits(f"cluster file: {k}", k, doc[k]) for k in ("bandwidth_mbps", "latency_ms") if k in doc}
        label = doc.get("name", name)
        return cls(tuple(devices), name=str(label), **extra)


def canonical_probe(doc: object, where: str = "probe") -> str:
    """A device's probe (engine.predictor.probe: "model:index" -> [forward_s, backward_s] per sample), checked,
    as the canonical JSON a Device carries; a UserError names what is wrong."""
    from engine.predictor.probe import check

    try:
        return json.dumps({k: list(v) for k, v in check(doc).items()}, sort_keys=True)
    except ValueError as exc:
        raise UserError(f"{where}: {exc}") from None


def _builtin(label: str, counts: list[tuple[str, int]]) -> Cluster:
    devices = tuple(Device.of_kind(f"{short}-{i}", short) for short, n in counts for i in range(n))
    return Cluster(devices, name=label)


# The clusters of the Asteroid paper's evaluation (docs/planning.md).
CLUSTERS: dict[str, Cluster] = {
    "A": _builtin("A", [("nano", 5)]),
    "B": _builtin("B", [("nx", 3), ("tx2", 2)]),
    "C": _builtin("C", [("nx", 1), ("tx2", 2), ("nano", 3)]),
    "D": _builtin("D", [("tx2", 1), ("nano", 3)]),
}


def load_cluster(arg: str, bandwidth_mbps: float | None = None) -> Cluster:
    """A built-in cluster by letter, or a cluster JSON file; optionally override the bandwidth."""
    if arg.upper() in CLUSTERS and not Path(arg).exists():
        cluster = CLUSTERS[arg.upper()]
    else:
        path = Path(arg)
        if path.is_dir():
            raise UserError(f"cluster file {arg} is a directory")
        if not path.is_file():
            if arg.endswith(".json") or "/" in arg:  # meant as a file
                raise UserError(f"cluster file {arg} does not exist")
            raise UserError(f"unknown cluster {arg!r}: use one of {', '.join(CLUSTERS)} or a cluster JSON file")
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read cluster file {arg}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"cluster file {arg} is not valid JSON: {exc}") from None
        cluster = Cluster.from_dict(doc, name=path.stem)
    if bandwidth_mbps is not None:
        cluster = cluster.with_bandwidth(bandwidth_mbps)
    return cluster
