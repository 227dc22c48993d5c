"""What a device needs of its stage: its layers, their boundary shapes, its part of the state dict, its calibration.

Shared by the Asteroid runtime (engine/runtime/worker.py) and the rivals it is measured against
(engine/runtime/rivals/), so both build, time and save a stage the same way.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.runtime.emulation import Clock, auto_dilation, measure_ratio, now
from engine.runtime.placement import Placement


class PeerLost(RuntimeError):
    """A collective or point-to-point operation failed because another device went away."""


def stage_module(layers: list[nn.Module], start: int, end: int) -> nn.Sequential:
    return nn.Sequential(*layers[start:end])


def part_state_dict(module: nn.Module, start: int) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers under the unpartitioned model's keys ("<layer index>.<name>"), low-rank
    adapters merged into their weights (engine.lora): the plain module's."""
    from engine.lora import merged

    out = {}
    for key, value in module.state_dict().items():
        index, rest = key.split(".", 1)
        out[f"{int(index) + start}.{rest}"] = value.detach().to("cpu", copy=True)
    return merged(out)


def boundary_examples(spec, layers: list[nn.Module], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample entering and one leaving layers [start, end), from one example sample through the layers
    before and in the stage (shapes and dtypes: token ids stay integers), on the host wherever the layers are."""
    x, _ = spec.example_batch(1, torch.Generator().manual_seed(0))
    x_in = x
    with torch.no_grad():
        for k in range(end):
            if k == start:
                x_in = x
            layers[k].eval()  # no batch-norm statistics updated by the probe
            x = _run(layers[k], x)
            layers[k].train()
    return x_in.cpu(), x.cpu()


def _run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer on `x`, where its weights are. A layer whose weights are on two devices (a weight tied to a later
    stage's, which this device computes on its GPU, beside the rest on the host) runs on host copies of them."""
    tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    devices = {t.device for t in tensors.values()}
    if len(devices) <= 1:
        return layer(x.to(next(iter(devices), x.device)))
    return torch.func.functional_call(layer, {k: t.cpu() for k, t in tensors.items()}, (x.cpu(),))


def calibrated_clock(
    dilation: float | None,
    spec,
    module: nn.Module,
    samples: int,
    shape_in: tuple | None,
    last: bool,
    forward_s: float,
    backward_s: float,
    store,
    rank: int,
    world: int,
    seed: int,
    place: Placement | None = None,
) -> Clock:
    """The clock of an emulated device: the given `dilation`, or one from every device's measured host/device
    time ratio (agreed through the rendezvous `store`). Either way the stage first runs once untimed, so no
    padded step pays for a cold start. `shape_in` None: the stage takes the model's own input. `place`: where the
    stage computes (engine.runtime.placement; its steps timed as the runtime times them)."""
    place = place or Placement("cpu")
    gen = torch.Generator().manual_seed(seed + 7919 * (rank + 1))

    def step() -> tuple[float, float]:
        x, y = spec.example_batch(samples, gen)
        if shape_in is not None:  # a later pipeline stage: activations in
            x = torch.randn((samples, *shape_in), generator=gen)
        x, y = place.load(x), place.load(y)
        x.requires_grad_(shape_in is not None)
        timer = place.timer()
        out = module(x)
        t = timer.started()
        t_f = now()
        timer = place.timer()
        if not out.requires_grad:  # every weight up to here frozen: a stage with no backward to compute
            pass
        elif last:
            spec.loss(out, y).backward()
        else:
            out.backward(place.load(torch.randn(out.shape, generator=gen)))
        t_b = timer.started()
        return t_f - t, now() - t_b

    state = {k: v.clone() for k, v in module.state_dict().items()}
    # dropout draws leave training's random streams as they were (a GPU's too: a user's nn.Dropout draws there)
    with torch.random.fork_rng(devices=[place.device] if place.cuda else []):
        if dilation is not None:
            step()  # warm-up only: the allocator, lazy initialisation
        else:
            try:
                ratio = measure_ratio(step, forward_s, backward_s, store, rank, world)
            except RuntimeError as exc:  # the store: a device that never came
                raise PeerLost(f"calibration failed: {gloo_message(exc)}") from None
    module.zero_grad(set_to_none=True)
    module.load_state_dict(state)  # batch-norm statistics as they were
    return Clock(dilation if dilation is not None else auto_dilation(ratio, world))


def gloo_group(store, rank: int, size: int, timeout: timedelta, address: str = ""):
    """A gloo process group whose connections bind to `address` (and advertise it to the peers). Without one, gloo
    takes the address the host name resolves to, which on a stock Ubuntu/JetPack board is 127.0.1.1: the peers
    on other boards would then be told a loopback address and never connect."""
    if not address:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def gloo_message(exc: Exception) -> str:
    """gloo's first sentence without its source location: "Connection closed by peer [127.0.0.1]:60099"."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return text.split(". ")[0].rstrip(".")
