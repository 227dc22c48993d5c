"""What the predictor sees: per-layer features from the model spec, per-device features from the device's probe."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from engine.models import get_model

# Leaf modules by the kind of work they do: matmul-bound (conv, linear), memory-bound (depthwise conv, the rest).
MATMUL = (nn.Linear,)
NORM = (nn.BatchNorm2d, nn.LayerNorm)
ACT = (nn.ReLU, nn.ReLU6, nn.GELU)
POOL = (nn.MaxPool2d, nn.AdaptiveAvgPool2d)
LAYER_FEATURES = (
    "fwd_flops",
    "bwd_flops",
    "conv_flops",
    "dw_flops",
    "linear_flops",
    "attn_flops",
    "norm_elems",
    "act_elems",
    "pool_elems",
    "embed_elems",
    "other_elems",
    "in_elems",
    "out_elems",
    "params",
    "leaves",
)
# An element of memory-bound work costs about this many FLOPs of matmul time (used only to weigh a layer's mix of
# work for the per-device correction, not as a prediction).
ELEM_FLOPS = 20.0


@cache
def layer_features(model: str) -> np.ndarray:
    """(layers, LAYER_FEATURES) raw per-sample figures of each layer of a zoo model, counted on one sample."""
    spec = get_model(model)
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = spec.layers()
        x, _ = spec.example_batch(1)
        for layer in layers:
            layer.train()
            x = x.detach().requires_grad_(x.is_floating_point())
            row, x = _one(layer, x)
            rows.append(row)
    return np.asarray(rows, dtype=float)


def _one(layer: nn.Module, x: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    acc = dict.fromkeys(LAYER_FEATURES, 0.0)

    def hook(module, inputs, output):
        out = float(output.numel())
        if isinstance(module, nn.Conv2d):
            macs = out * module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            acc["dw_flops" if module.groups > 1 else "conv_flops"] += 2.0 * macs
        elif isinstance(module, MATMUL):
            acc["linear_flops"] += 2.0 * out * module.in_features
        elif isinstance(module, NORM):
            acc["norm_elems"] += out
        elif isinstance(module, ACT):
            acc["act_elems"] += out
        elif isinstance(module, POOL):
            acc["pool_elems"] += float(inputs[0].numel())
        elif isinstance(module, nn.Embedding):
            acc["embed_elems"] += out
        else:
            acc["other_elems"] += out
        acc["leaves"] += 1

    leaves = [m for m in layer.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with FlopCounterMode(display=False) as fwd:
            y = layer(x)
        with FlopCounterMode(display=False) as bwd:
            y.backward(torch.ones_like(y))
    finally:
        for h in handles:
            h.remove()
    acc["fwd_flops"] = float(fwd.get_total_flops())
    acc["bwd_flops"] = float(bwd.get_total_flops())
    acc["attn_flops"] = max(0.0, acc["fwd_flops"] - acc["conv_flops"] - acc["dw_flops"] - acc["linear_flops"])
    acc["in_elems"] = float(x.numel())
    acc["out_elems"] = float(y.numel())
    acc["params"] = float(sum(p.numel() for p in layer.parameters()))
    acc["leaves"] = max(acc["leaves"], 1.0)
    return [acc[k] for k in LAYER_FEATURES], y.detach()


def model_matrix(model: str, micro_batch: int) -> np.ndarray:
    """The predictor's layer inputs: log1p of each feature, and log of the micro-batch (per-op overheads are paid
    once per micro-batch, so per-sample times fall as it grows)."""
    raw = layer_features(model)
    return np.column_stack([np.log1p(raw), np.full(len(raw), math.log(micro_batch))])


def work_mix(model: str) -> np.ndarray:
    """(layers, 4) each layer's share of dense-matmul, depthwise, attention-matmul and memory-bound work, in FLOP
    equivalents: what the per-device correction weighs (memory-bound work is where devices differ most)."""
    raw = layer_features(model)
    col = {k: raw[:, i] for i, k in enumerate(LAYER_FEATURES)}
    elems = sum(col[k] for k in ("norm_elems", "act_elems", "pool_elems", "embed_elems", "other_elems"))
    parts = np.column_stack(
        [col["conv_flops"] + col["linear_flops"], col["dw_flops"], col["attn_flops"], ELEM_FLOPS * elems]
    )
    total = parts.sum(axis=1, keepdims=True)
    return np.divide(parts, total, out=np.full_like(parts, 0.25), where=total > 0)


def device_features(probe_log: np.ndarray) -> np.ndarray:
    """Per-device inputs from its probe's log seconds (forward and backward of each probe layer): their shape
    relative to the mean, i.e. which kinds of layers this device is fast or slow at. The mean itself (its
    speed) is taken out of the target instead, so the predictor carries to faster or slower boards."""
    return probe_log - probe_log.mean()
