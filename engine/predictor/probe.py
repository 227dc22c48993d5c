"""The probe a device of no known kind runs when it enrolls: a handful of zoo layers timed on it (seconds)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

# One layer of each kind of work the zoo does, on small inputs: a dense conv, a conv + BN + ReLU6 stem, a
# depthwise block, a bottleneck, ReLU and max-pool (memory-bound), the classifier's big linear, an embedding,
# a pre-norm and a post-norm transformer block. "model:layer index".
PROBE_KEYS = (
    "vgg16:2",
    "vgg16:3",
    "vgg16:4",
    "vgg16:32",
    "mobilenetv2:0",
    "mobilenetv2:3",
    "resnet50:4",
    "gpt-small:0",
    "gpt-small:1",
    "bert-small:1",
)
PROBE_BATCH = 8  # the planner's profile micro-batch (engine.workloads.PROFILE_BATCH)


def check(doc: object) -> dict[str, tuple[float, float]]:
    """A probe from outside (an agent's hello, a cluster file), as {key: (forward_s, backward_s)} per sample;
    ValueError names what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError(f'probe must be an object of "model:layer": [forward_s, backward_s], got {doc!r:.60}')
    missing = [k for k in PROBE_KEYS if k not in doc]
    if missing:
        raise ValueError(f"probe lacks layers {', '.join(missing)}")
    out = {}
    for key in PROBE_KEYS:
        v = doc[key]
        times = [_seconds(t) for t in v] if isinstance(v, (list, tuple)) and len(v) == 2 else [None]
        if None in times:
            raise ValueError(
                f"probe {key}: needs [forward_s, backward_s], seconds per sample between {MIN_S:g} and {MAX_S:g}, "
                f"got {v!r:.60}"
            )
        out[key] = (times[0], times[1])
    return out


MIN_S, MAX_S = 1e-9, 60.0  # per sample of a probe layer: a nanosecond is beyond any board, a minute broken


def _seconds(t: object) -> float | None:
    """`t` as seconds when it is a plausible probe time, else None."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    try:
        t = float(t)
    except OverflowError:  # an int beyond float's range
        return None
    return t if MIN_S <= t <= MAX_S else None  # NaN fails both


def run_probe(config=None) -> dict[str, tuple[float, float]]:
    """Time the probe layers here, as the runtime runs them (one CPU thread, float32) unless `config` says
    otherwise: {key: (forward_s, backward_s)} per sample at PROBE_BATCH."""
    from engine.predictor.configs import Config
    from engine.predictor.measure import layer_times

    config = config or Config("here")
    wanted: dict[str, set[int]] = defaultdict(set)
    for key in PROBE_KEYS:
        model, index = key.split(":")
        wanted[model].add(int(index))
    out = {}
    for model, indices in wanted.items():
        for i, (f, b) in layer_times(model, config, PROBE_BATCH, only=indices).items():
            out[f"{model}:{i}"] = (f, b)
    return {k: out[k] for k in PROBE_KEYS}


def probe_vector(probe: dict) -> np.ndarray:
    """Log seconds of the probe, forward then backward of each key in PROBE_KEYS order."""
    return np.log([probe[k][d] for d in (0, 1) for k in PROBE_KEYS])


def from_measurements(per_model: dict[str, list[list[float]]]) -> dict[str, tuple[float, float]]:
    """The probe a measured configuration would have run: its times of the probe layers (at PROBE_BATCH)."""
    out = {}
    for key in PROBE_KEYS:
        model, index = key.split(":")
        f, b = per_model[model][int(index)]
        out[key] = (f, b)
    return out
