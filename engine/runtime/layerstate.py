"""A layer's whole training state (weights, buffers, optimizer state) as plain host tensors: captured, moved as
bytes, put back (into layers on the host or a GPU).

    states = capture(layers, 6, 12, optimizer)     # {6: {"p.weight": ..., "b.running_mean": ..., "o.weight.step": ...}}
    data = to_bytes(states); states = from_bytes(data)
    state = apply(layers, states)                  # {parameter: its optimizer state} for the new optimizer

The optimizer's state of a parameter is every tensor torch keeps for it (SGD's momentum buffer; Adam's moments and
its step count), none before its first step (a fresh optimizer's), so a restored layer trains on exactly as the
lost one would have.
"""

from __future__ import annotations

import io

import torch
from torch import nn

LayerStates = dict[int, dict[str, torch.Tensor]]


def capture(layers: list[nn.Module], start: int, end: int, optimizer: torch.optim.Optimizer | None) -> LayerStates:
    """Copies of layers [start, end): parameters, buffers and each parameter's optimizer state."""
    out: LayerStates = {}
    for index in range(start, end):
        layer, state = layers[index], {}
        for name, p in layer.named_parameters():
            state[f"p.{name}"] = _copy(p)
            held = optimizer.state.get(p, {}) if optimizer is not None else {}
            for what, value in held.items():
                if torch.is_tensor(value):
                    state[f"o.{name}.{what}"] = _copy(value)
        for name, b in layer.named_buffers():
            state[f"b.{name}"] = _copy(b)
        out[index] = state
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy (a layer on a GPU keeps its copies in the host's memory, and they travel as bytes)."""
    return t.detach().to("cpu", copy=True)


def apply(layers: list[nn.Module], states: LayerStates) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Write `states` into the layers; returns each parameter's optimizer state (empty before its first step) for
    the optimizer that trains them."""
    optimizer = {}
    with torch.no_grad():
        for index, state in states.items():
            layer = layers[index]
            for name, p in layer.named_parameters():
                p.copy_(state[f"p.{name}"])
                prefix = f"o.{name}."
                optimizer[p] = {k[len(prefix) :]: v.clone() for k, v in state.items() if k.startswith(prefix)}
            for name, b in layer.named_buffers():
                b.copy_(state[f"b.{name}"])
    return optimizer


def select(states: LayerStates, start: int, end: int) -> LayerStates:
    return {k: v for k, v in states.items() if start <= k < end}


def nbytes(states: LayerStates) -> int:
    return sum(t.numel() * t.element_size() for s in states.values() for t in s.values())


def to_bytes(states: LayerStates) -> bytes:
    buf = io.BytesIO()
    torch.save(states, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> LayerStates:
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def buffers(layers: list[nn.Module], start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) of every buffer of layers [start, end): batch-norm statistics as an iteration found them."""
    return [(b, b.detach().clone()) for layer in layers[start:end] for b in layer.buffers()]
