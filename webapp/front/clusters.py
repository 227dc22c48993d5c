"""The engine's built-in clusters A–D as rows for display."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.devices import CLUSTERS, KINDS, Cluster


@dataclass(frozen=True)
class ClusterRow:
    name: str
    composition: str  # "1× Jetson Xavier NX + 2× Jetson TX2"
    devices: list[tuple[str, str]]  # (device name, kind label)
    memory_gb: float
    gflops: float
    bandwidth_mbps: float


def _label(kind: str) -> str:
    return KINDS[kind].label if kind in KINDS else kind


def cluster_row(cluster: Cluster) -> ClusterRow:
    counts = Counter(d.kind for d in cluster.devices)  # insertion order: as the cluster lists them
    return ClusterRow(
        name=cluster.name,
        composition=" + ".join(f"{n}× {_label(kind)}" for kind, n in counts.items()),
        devices=[(d.name, _label(d.kind)) for d in cluster.devices],
        memory_gb=sum(d.memory_gb for d in cluster.devices),
        gflops=sum(d.gflops for d in cluster.devices),
        bandwidth_mbps=cluster.bandwidth_mbps,
    )


def builtin_cluster_rows() -> list[ClusterRow]:
    return [cluster_row(c) for c in CLUSTERS.values()]
