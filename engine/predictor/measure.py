"""Per-layer forward and backward seconds per sample of zoo models, really measured under one configuration."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.models import get_model
from engine.predictor.configs import Config
from engine.progress import Progress

DATA_DIR = Path(__file__).parent / "data"
MEASUREMENTS = DATA_DIR / "measurements.json"
MICRO_BATCHES = (2, 8)
MIN_REPEATS, MIN_SECONDS, MAX_REPEATS = 5, 0.05, 50
# A measurement of the training set is this many passes over every cell, one after the other, and each layer's time
# the median of its passes: a shared host's load drifts over minutes, and a pass-to-pass median smooths the drift
# that a median of back-to-back repeats inside one pass cannot.
ROUNDS = 3


def time_layer(layer: nn.Module, x: Tensor, config: Config) -> tuple[float, float, Tensor]:
    """Median forward and backward seconds of `layer` on `x` (whole micro-batch), and its output. Repeats until
    MIN_REPEATS and MIN_SECONDS of samples (fast layers get more, for a stable median), after two warm-ups."""
    forward, backward, grad, spent, r = [], [], None, 0.0, 0
    while r < 2 + MIN_REPEATS or (spent < MIN_SECONDS and r < 2 + MAX_REPEATS):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        config.sync()
        t0 = time.perf_counter()
        y = layer(x)
        config.sync()
        t1 = time.perf_counter()
        if grad is None:
            grad = torch.randn_like(y)
        y.backward(grad)
        config.sync()
        t2 = time.perf_counter()
        if r >= 2:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            spent += t2 - t0
        r += 1
    return statistics.median(forward), statistics.median(backward), y.detach()


def layer_times(model: str, config: Config, micro_batch: int, only: set[int] | None = None) -> dict[int, list[float]]:
    """{layer index: [forward_s, backward_s] per sample} of `model` under `config`, each layer on the input it
    really receives; `only` limits timing to those layers (the others just run forward to make inputs)."""
    spec = get_model(model)
    out: dict[int, list[float]] = {}
    with config.active(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = spec.layers()
        x, _ = spec.example_batch(micro_batch)
        x = config.tensor(x)
        last = max(only) if only else len(layers) - 1
        for i, layer in enumerate(layers[: last + 1]):
            layer = config.layer(layer).train()
            if only is None or i in only:
                x = x.detach().requires_grad_(x.is_floating_point())
                if not x.requires_grad and not any(p.requires_grad for p in layer.parameters()):
                    raise ValueError(f"{model} layer {i} has nothing to differentiate")
                f, b, x = time_layer(layer, x, config)
                out[i] = [f / micro_batch, b / micro_batch]
            else:
                with torch.no_grad():
                    x = layer(x)
    return out


def _threads() -> list[int]:
    """The ids of this process's threads (Linux), or [0]: the calling thread."""
    return [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]


def _set_affinity(cpus) -> None:
    for task in _threads():
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(task, cpus)


@contextlib.contextmanager
def pinned(threads: int):
    """Run every thread of this process on the same `threads` CPUs (the last ones this process may use: the first
    tends to take the machine's interrupts) until the block ends, so a measurement's threads do not migrate
    between cores; the CPUs allowed before are restored. Where affinity cannot be set, nothing changes."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    _set_affinity(set(allowed[-threads:]))
    try:
        yield
    finally:
        _set_affinity(allowed)


def measure(
    configs: list[Config],
    models: list[str],
    micro_batches=MICRO_BATCHES,
    path: Path = MEASUREMENTS,
    progress=True,
    section: str = "configs",
    rounds: int = ROUNDS,
) -> dict:
    """Measure every (configuration, model, micro-batch) `rounds` times, pass after pass with each configuration's
    threads pinned to CPUs (`pinned`), and merge each layer's median of the passes into the measurements file at
    `path`, under `section`: "configs" (the training set) or "repeat" (the same configurations measured again: how
    much a measurement itself moves on this machine, the floor under any prediction's error)."""
    doc = load(path) if path.exists() else {"version": 1, "configs": {}}
    doc["host"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    doc.setdefault("method", {})[section] = {"rounds": rounds, "pinned": hasattr(os, "sched_setaffinity")}
    cells = [(config, model, mb) for config in configs for model in models for mb in micro_batches]
    passes: dict[tuple, list[dict[int, list[float]]]] = {}
    with Progress(len(cells) * rounds, "measuring layers", progress) as bar:
        for r in range(rounds):
            for config, model, mb in cells:
                with pinned(config.threads):
                    passes.setdefault((config.name, model, mb), []).append(layer_times(model, config, mb))
                bar.update(note=f"pass {r + 1}/{rounds}: {config.name} {model} x{mb}")
                if r == rounds - 1:  # a cell is stored once measured in every pass: an interrupted run keeps those
                    times = passes[(config.name, model, mb)]
                    doc.setdefault(section, {}).setdefault(config.name, {}).setdefault(model, {})[str(mb)] = [
                        [statistics.median(p[i][d] for p in times) for d in (0, 1)] for i in range(len(times[0]))
                    ]
                    save(doc, path)
    return doc


def load(path: Path = MEASUREMENTS) -> dict:
    return json.loads(Path(path).read_text())


def save(doc: dict, path: Path = MEASUREMENTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)
