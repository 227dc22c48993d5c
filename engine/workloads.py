"""Workloads of zoo models, from their cached host profiles (profiling on first use, with progress)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from engine.costmodel import Workload
from engine.devices import Cluster
from engine.errors import UserError
from engine.models import get_model
from engine.profiler import cached_profile, default_cache_dir, host_id

# Per-sample costs are measured at this micro-batch size (small enough for every model on a 2-core host).
PROFILE_BATCH = 8


def workload(
    model: str,
    profile_batch: int = PROFILE_BATCH,
    refresh: bool = False,
    optimizer: str = "sgd",
    cluster: Cluster | None = None,
) -> Workload:
    """The planning workload of a zoo model; unknown names raise UserError listing the models. With a `cluster`,
    its devices that carry a probe (no known kind) get the latency predictor's per-layer times."""
    spec = get_model(model)
    profile = cached_profile(
        spec, micro_batch=profile_batch, refresh=refresh, progress=sys.stderr.isatty(), optimizer=optimizer
    )
    rate = profile.total_flops / profile.total_host_s if profile.total_host_s > 0 else 1.0
    codec = tuple((bits, seconds * rate) for bits, seconds in sorted(codec_seconds().items()))
    w = replace(Workload.from_profile(profile), codec_work=codec)
    probed = [d for d in (cluster.devices if cluster is not None else ()) if d.probe]
    if probed:
        from engine.predictor.adapt import predicted_times

        try:
            times = {d.name: predicted_times(model, json.loads(d.probe), profile_batch) for d in probed}
            w = w.with_device_times(times)
        except ValueError as exc:  # a probe the checks let through but the predictor cannot use
            raise UserError(f"cannot predict {model}'s layer times from a device's probe: {exc}") from None
    return w


def codec_seconds() -> dict[int, float]:
    """Host seconds per value to encode and decode at each compression level (engine.compression), measured
    once per host and cached beside the profiles."""
    from engine.compression import measure_codec

    path = default_cache_dir() / f"codec-v2-{host_id()}.json"  # v2: with stochastic rounding
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # missing or corrupt: measure again
    measured = measure_codec(repeats=9)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(measured))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again next time
    return measured
