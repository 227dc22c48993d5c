"""Random small planning instances (workload + heterogeneous cluster) for planner tests and benchmarks."""

from __future__ import annotations

import random

from engine.costmodel import Workload
from engine.devices import Cluster, Device

KINDS = ("nano", "tx2", "nx")


def random_workload(rng: random.Random, layers: int, name: str = "synthetic") -> Workload:
    fwd = [rng.uniform(0.2e9, 3e9) for _ in range(layers)]
    return Workload(
        model=name,
        forward_flops=tuple(fwd),
        backward_flops=tuple(f * rng.uniform(1.5, 2.5) for f in fwd),
        output_bytes=tuple(rng.randint(20_000, 2_000_000) for _ in range(layers)),
        saved_bytes=tuple(rng.randint(50_000, 20_000_000) for _ in range(layers)),
        peak_bytes=tuple(rng.randint(50_000, 5_000_000) for _ in range(layers)),
        param_bytes=tuple(rng.randint(10_000, 60_000_000) for _ in range(layers)),
        optimizer_bytes=tuple(rng.randint(10_000, 60_000_000) for _ in range(layers)),
    )


def random_cluster(rng: random.Random, devices: int, bandwidth_mbps: float | None = None) -> Cluster:
    kinds = rng.sample(KINDS, rng.randint(2, 3))
    return Cluster(
        tuple(Device.of_kind(f"d{i}", rng.choice(kinds)) for i in range(devices)),
        bandwidth_mbps=bandwidth_mbps or rng.choice([100.0, 1000.0]),
        name="random",
    )
