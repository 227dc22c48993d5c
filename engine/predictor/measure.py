"""Per-layer forward and backward seconds per sample of zoo models, really measured under one configuration."""

from __future__ import annotations

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


def measure(
    configs: list[Config],
    models: list[str],
    micro_batches=MICRO_BATCHES,
    path: Path = MEASUREMENTS,
    progress=True,
    section: str = "configs",
) -> dict:
    """Measure every (configuration, model, micro-batch) and merge it into the measurements file at `path`, under
    `section`: "configs" (the training set) or "repeat" (the same configurations measured again: how much a
    measurement itself moves on this machine, the floor under any prediction's error)."""
    doc = load(path) if path.exists() else {"version": 1, "configs": {}}
    doc["host"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    with Progress(len(configs) * len(models) * len(micro_batches), "measuring layers", progress) as bar:
        for config in configs:
            for model in models:
                for mb in micro_batches:
                    times = layer_times(model, config, mb)
                    doc.setdefault(section, {}).setdefault(config.name, {}).setdefault(model, {})[str(mb)] = [
                        times[i] for i in range(len(times))
                    ]
                    bar.update(note=f"{config.name} {model} x{mb}")
                    save(doc, path)  # after every cell: an interrupted run keeps what it measured
    return doc


def load(path: Path = MEASUREMENTS) -> dict:
    return json.loads(Path(path).read_text())


def save(doc: dict, path: Path = MEASUREMENTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)
