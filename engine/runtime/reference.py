"""One process training the unpartitioned model on the pipeline's batches: what a pipeline run must equal.

    losses, state = one_process("gpt-small", batch=16, options=RunOptions(iterations=3, lr=0.05), device="cuda")

The same recipe (engine.recipe: optimizer, schedule, clipping with torch's clip_grad_norm_, frozen weights, LoRA),
the same batches (engine.runtime.batches) and dropout masks (engine.models.randomness); 16-bit under autocast, fp16
with torch.amp.GradScaler, whose rule the pipeline's agreed loss scale follows (engine.runtime.precision).
"""

from __future__ import annotations

import contextlib

import torch

from engine import recipe
from engine.data import get_dataset
from engine.models import get_model
from engine.models.randomness import sample_draws
from engine.runtime.batches import batch_indices, load
from engine.runtime.options import RunOptions
from engine.runtime.precision import DTYPES


def one_process(
    model: str, batch: int, options: RunOptions, device: str = "cpu", iterations: int | None = None
) -> tuple[list[float], dict]:
    """(loss per iteration, final state_dict on the host) of the first `iterations` (default: all) of the run
    `options` describes (its learning-rate schedule is the whole run's), on `device`."""
    opts, spec = options, get_model(model)
    torch.manual_seed(opts.seed)
    net = spec.sequential()
    recipe.prepare(spec, list(net), opts)
    net.to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = recipe.make_optimizer(params, opts)
    dtype = DTYPES[opts.precision]
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=opts.precision == "fp16")
    data = get_dataset("synthetic", spec, size=opts.dataset_size, seed=opts.seed)
    losses = []
    for k in range(opts.iterations if iterations is None else iterations):
        x, y = load(data, batch_indices(len(data), batch, opts.seed, k))
        x, y = x.to(device), y.to(device)
        half = torch.autocast(torch.device(device).type, dtype=dtype) if dtype else contextlib.nullcontext()
        with sample_draws(opts.seed, k, range(0, batch)), half:
            loss = spec.loss(net(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if opts.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.clip_grad_norm)
        recipe.set_lr(opt, opts, k)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in net.state_dict().items()}
