"""The plans that describe what each rival runs, so the cost model, the simulator and the step durations judge
them by the same rules as Asteroid's plans."""

from __future__ import annotations

from engine.costmodel import Workload
from engine.devices import Cluster
from engine.errors import UserError
from engine.plan import Plan, Share, Stage


def ddp_plan(workload: Workload, cluster: Cluster, batch_size: int) -> Plan:
    """One stage of every device holding the whole model, equal shares (remainder to the first devices)."""
    g = len(cluster.devices)
    if batch_size < g:
        raise UserError(f"ddp: batch size {batch_size} is smaller than the {g} devices of cluster {cluster.name}")
    q, extra = divmod(batch_size, g)
    shares = tuple(Share(d.name, q + (k < extra)) for k, d in enumerate(cluster.devices))
    return Plan("ddp", workload.model, batch_size, 1, (Stage(0, workload.num_layers, shares),), cluster)


def pipelining_plan(workload: Workload, cluster: Cluster, batch_size: int, micro_batches: int) -> Plan:
    """One device per stage in cluster order, layers split evenly by count (as torch's pipelining examples do)."""
    L = workload.num_layers
    devices = cluster.devices[:L]
    S = len(devices)
    if micro_batches < S:
        raise UserError(f"pipelining: 1F1B over {S} stages needs at least {S} micro-batches, got {micro_batches}")
    if batch_size % micro_batches:
        raise UserError(f"pipelining: batch size {batch_size} is not divisible into {micro_batches} micro-batches")
    bounds = [k * L // S for k in range(S + 1)]
    m = batch_size // micro_batches
    stages = tuple(Stage(bounds[k], bounds[k + 1], (Share(d.name, m),)) for k, d in enumerate(devices))
    return Plan("pipelining", workload.model, batch_size, micro_batches, stages, cluster)
