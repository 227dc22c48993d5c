"""A layer's whole training state (weights, buffers, momentum) as plain tensors: captured, moved as bytes, put back.

    states = capture(layers, 6, 12, optimizer)     # {6: {"p.weight": ..., "b.running_mean": ..., "m.weight": ...}, ...}
    data = to_bytes(states); states = from_bytes(data)
    momentum = apply(layers, states)               # {parameter: momentum buffer} for the new optimizer

Momentum is kept for every parameter (zeros before the first step: SGD's first step then gives exactly what
a fresh buffer would), so a restored layer trains on exactly as the lost one would have.
"""

from __future__ import annotations

import io

import torch
from torch import nn

LayerStates = dict[int, dict[str, torch.Tensor]]


def capture(layers: list[nn.Module], start: int, end: int, optimizer: torch.optim.Optimizer | None) -> LayerStates:
    """Copies of layers [start, end): parameters, buffers and each parameter's momentum."""
    out: LayerStates = {}
    for index in range(start, end):
        layer, state = layers[index], {}
        for name, p in layer.named_parameters():
            state[f"p.{name}"] = p.detach().clone()
            buf = optimizer.state.get(p, {}).get("momentum_buffer") if optimizer is not None else None
            state[f"m.{name}"] = buf.detach().clone() if buf is not None else torch.zeros_like(p)
        for name, b in layer.named_buffers():
            state[f"b.{name}"] = b.detach().clone()
        out[index] = state
    return out


def apply(layers: list[nn.Module], states: LayerStates) -> dict[nn.Parameter, torch.Tensor]:
    """Write `states` into the layers; returns each parameter's momentum for the optimizer that trains them."""
    momentum = {}
    with torch.no_grad():
        for index, state in states.items():
            layer = layers[index]
            for name, p in layer.named_parameters():
                p.copy_(state[f"p.{name}"])
                momentum[p] = state[f"m.{name}"].clone()
            for name, b in layer.named_buffers():
                b.copy_(state[f"b.{name}"])
    return momentum


def select(states: LayerStates, start: int, end: int) -> LayerStates:
    return {k: v for k, v in states.items() if start <= k < end}


def nbytes(states: LayerStates) -> int:
    return sum(t.numel() * t.element_size() for s in states.values() for t in s.values())


def to_bytes(states: LayerStates) -> bytes:
    buf = io.BytesIO()
    torch.save(states, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> LayerStates:
    return torch.load(io.BytesIO(data), weights_only=True)


def buffers(layers: list[nn.Module], start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) of every buffer of layers [start, end): batch-norm statistics as an iteration found them."""
    return [(b, b.detach().clone()) for layer in layers[start:end] for b in layer.buffers()]
