"""Weights in and out in the user's own keys: a run's starting weights (`--init FILE`) and its trained model
(`--save FILE`), as a `state_dict` file (`.pt`, read with weights_only=True) or safetensors (`.safetensors`).

A zoo model's keys are its layer list's (`3.conv.weight`); a user's module's are the module's own
(`blocks.0.conv1.weight`): its layers hold its submodules under their own names (engine.models.graph), so
`FUNCTION().load_state_dict(torch.load(FILE), strict=True)` reads what `--save FILE` wrote.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.errors import UserError
from engine.models.spec import ModelSpec

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")  # a state_dict file; else a Hugging Face model's folder


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from a `.pt`/`.pth` (tensors only: no code runs) or a `.safetensors` file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated file, a pickle holding code, not a state_dict at all
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise UserError(f"cannot read weights file {path}: {first[:160]}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise UserError(f"weights file {path} does not hold a state_dict (names to tensors)")
    return state


def write_state(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write a state_dict: safetensors when the name ends so, else torch.save."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        else:
            torch.save(state, path)
    except OSError as exc:
        raise UserError(f"cannot write model {path}: {exc.strerror or exc}") from None


def save_model(spec: ModelSpec, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write a run's assembled state as the model's own: a state_dict file, or (a Hugging Face model and a path
    without a weights suffix) a folder `from_pretrained` reads."""
    path = Path(path)
    mine = user_keys(spec, state)
    if spec.name.startswith("hf:") and path.suffix not in WEIGHT_SUFFIXES:
        from engine.models.hf import save_folder
        from engine.models.source import parse_reference

        save_folder(spec.build, parse_reference(spec.name).path, mine, path)
    else:
        write_state(mine, path)


def user_keys(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A run's assembled state (`<layer>.<name>` keys, engine.runtime.stage.part_state_dict) in the model's own
    keys: a user's module's, or the zoo's layer list's (unchanged)."""
    if spec.chain is None:
        return state
    mine = {key.split(".", 1)[1]: value for key, value in state.items()}
    for names in spec.chain.aliases:  # a tied weight under each of its names, as the module's state_dict has it
        held = next((mine[n] for n in names if n in mine), None)
        if held is not None:
            mine.update(dict.fromkeys(names, held))
    return mine


def load_into(spec: ModelSpec, layers: list[nn.Module], state: dict[str, torch.Tensor], source: str = "") -> None:
    """Put `state` (the model's own keys) into `layers`; every key must match, or one line names the first
    missing and unexpected ones and nothing is changed."""
    wanted: dict[str, list[tuple[int, str]]] = {}  # (a buffer several layers read is in each of them)
    for i, layer in enumerate(layers):
        for name in layer.state_dict():
            wanted.setdefault(name if spec.chain is not None else f"{i}.{name}", []).append((i, name))
    other = {}  # a tied weight's other names: either may be in the file
    for names in spec.chain.aliases if spec.chain is not None else ():
        for n in names:
            other[n] = [m for m in names if m != n]
    state = {**{k: state[a] for k in wanted if k not in state for a in other.get(k, ()) if a in state}, **state}
    missing = [k for k in wanted if k not in state]
    unexpected = [k for k in state if k not in wanted and not any(a in wanted for a in other.get(k, ()))]
    if missing or unexpected:
        parts = [f"missing {_few(missing)}" if missing else "", f"unexpected {_few(unexpected)}" if unexpected else ""]
        raise UserError(f"weights {source or ''} do not match {spec.name}: " + "; ".join(p for p in parts if p))
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    for key, holders in wanted.items():
        for i, name in holders:
            have = layers[i].state_dict()[name]
            if tuple(state[key].shape) != tuple(have.shape):
                raise UserError(f"weights {source}: {key} has shape {tuple(state[key].shape)}, the model's is "
                                f"{tuple(have.shape)}")  # fmt: skip
            per_layer[i][name] = state[key].to(have.dtype)
    with torch.no_grad():
        for layer, part in zip(layers, per_layer):
            layer.load_state_dict(part, strict=True)


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def initial_layers(spec: ModelSpec, seed: int, init: str | None = None) -> list[nn.Module]:
    """The run's starting layers, the same in every process: built under `seed`, then loaded from `init`."""
    torch.manual_seed(seed)
    layers = spec.layers()
    if init:
        load_into(spec, layers, read_state(init), init)
    return layers
