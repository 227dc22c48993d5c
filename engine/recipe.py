"""The training recipe: the optimizer (SGD, Adam, AdamW; no weight decay on biases and norms), the learning rate of
each iteration (warm-up, then constant, linear or cosine), clipping by the global gradient norm, which weights are
frozen or adapted, the defaults a model's family brings, what the planner plans for, and when a run diverged; the
same functions serve every device of a pipeline and the one-process reference.

    optimizer = make_optimizer(params, options)            # None when nothing is trained
    set_lr(optimizer, options, k)                          # before iteration k's step (k from 0)
    coefficient = clip_coefficient(total_squares, options.clip_grad_norm)
    prepare(spec, layers, options)                         # adapters (engine.lora), frozen weights
    w = planned(w, options)                                # optimizer state, frozen weights, 16-bit cuts
    family_defaults(spec, iterations)                      # {"optimizer": "adamw", ...} for a transformer
    divergence(event, chance_loss(spec))                   # why the run diverged, or None

The learning rate of iteration k is `lr * lr_factor(k, ...)`: a pure function of k, so replays and resumed runs
step with exactly the rate of an uninterrupted run. Each optimizer's state (momentum; Adam's moments and step
count) is per parameter and travels with the layer (engine.runtime.layerstate).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: run options (and the site's forms) read this module
    import torch
    from torch import nn

    from engine.costmodel import Workload
    from engine.models.spec import ModelSpec

OPTIMIZER_CHOICES = (
    ("sgd", "SGD with momentum"),
    ("adam", "Adam (weight decay added to the gradient)"),
    ("adamw", "AdamW (decoupled weight decay)"),
)
LR_SCHEDULE_CHOICES = (
    ("constant", "constant (after the warm-up)"),
    ("linear", "linear decay to 0"),
    ("cosine", "cosine decay to 0"),
)
PRECISION_CHOICES = (
    ("fp32", "fp32"),
    ("bf16", "bf16 (autocast; its cuts carry bfloat16)"),
    ("fp16", "fp16 (autocast, a dynamic loss scale; its cuts carry float16)"),
)
# What a model brings when its owner sets none of these: transformers the Hugging Face Trainer's recipe (AdamW,
# warm-up over a tenth of the run, then cosine; clipping at norm 1), every other model RunOptions' own (SGD with
# momentum 0.9 at 0.05, constant).
FAMILY_RECIPES = {
    "transformer": {
        "optimizer": "adamw",
        "lr": 3e-4,
        "weight_decay": 0.01,
        "lr_schedule": "cosine",
        "clip_grad_norm": 1.0,
    },  # fmt: skip
    "other": {},
}
RECIPE_OPTIONS = ("optimizer", "lr", "weight_decay", "lr_schedule", "warmup", "clip_grad_norm")
CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coefficient = max_norm / (norm + 1e-6), at most 1


def family(spec: ModelSpec) -> str:
    """The recipe family: "transformer" for a model of that family, or one that holds attention or layer norms (a
    user's ViT on images too); else "other"."""
    if spec.family == "transformer" or spec.input_dtype == "int64":
        return "transformer"
    for layer in model_layers(spec):
        for module in layer.modules():
            kind = type(module).__name__
            if "Attention" in kind or kind in ("LayerNorm", "RMSNorm") or kind.endswith("RMSNorm"):
                return "transformer"
    return "other"


def family_defaults(spec: ModelSpec, iterations: int) -> dict:
    """The recipe options `spec`'s family brings (FAMILY_RECIPES; a transformer's warm-up: a tenth of the run)."""
    kind = family(spec)
    found = dict(FAMILY_RECIPES[kind])
    if kind == "transformer":
        found["warmup"] = iterations // 10
    return found


def defaults_text(name: str, other) -> str:
    """How the default of recipe option `name` (`other` for models other than transformers) depends on the model:
    "adamw for transformers, sgd for other models"."""
    value = FAMILY_RECIPES["transformer"].get(name, "a tenth of the run" if name == "warmup" else other)
    show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
    return f"{show(value)} for transformers, {show(other)} for other models"


def optimizer_states(optimizer: str, momentum: float = 0.9) -> int:
    """Tensors of optimizer state per trained parameter, each the parameter's size."""
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    return 2  # Adam and AdamW: the first and second moments


def lr_factor(k: int, iterations: int, schedule: str, warmup: int) -> float:
    """The multiple of the learning rate that iteration k (from 0) of `iterations` steps with: rising linearly over
    the first `warmup` iterations ((k + 1) / warmup), then `schedule` from 1 towards 0 at the end."""
    if k < warmup:
        return (k + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (k - warmup) / max(1, iterations - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def no_decay(p: torch.Tensor) -> bool:
    """Biases and normalisation weights (one dimension or none) take no weight decay, as Hugging Face's Trainer
    and nanoGPT leave them out."""
    return p.ndim < 2


def make_optimizer(params: list[nn.Parameter], options) -> torch.optim.Optimizer | None:
    """The optimizer of `options` (engine.runtime.options.RunOptions) over `params` (each once), torch's defaults
    for betas and eps; None when there is nothing to train."""
    import torch

    if not params:
        return None
    decay = [p for p in params if not no_decay(p)]
    rest = [p for p in params if no_decay(p)]
    groups = [g for g in ({"params": decay, "weight_decay": options.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]  # fmt: skip
    if options.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=options.lr, momentum=options.momentum)
    if options.optimizer == "adam":
        return torch.optim.Adam(groups, lr=options.lr)
    return torch.optim.AdamW(groups, lr=options.lr)


def set_lr(optimizer: torch.optim.Optimizer | None, options, k: int) -> float:
    """Set the learning rate iteration k steps with; returns it."""
    lr = options.lr * lr_factor(k, options.iterations, options.lr_schedule, options.warmup)
    for group in optimizer.param_groups if optimizer is not None else ():
        group["lr"] = lr
    return lr


def step(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor], options, k: int,
         clip: float | None) -> None:  # fmt: skip
    """Iteration k's optimizer step at its learning rate, the gradients first multiplied by `clip` (the global
    norm's clipping coefficient, times fp16's unscaling), then cleared. `clip` None: no step (an overflow)."""
    if optimizer is None:
        return
    if clip is None:
        optimizer.zero_grad(set_to_none=True)
        return
    set_lr(optimizer, options, k)
    if clip != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def squares(params: list[torch.Tensor]) -> float:
    """The sum of the squares of these parameters' gradients (float64): a stage's share of the global norm."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def clip_coefficient(total_squares: float, max_norm: float) -> float:
    """What every gradient is multiplied by so that their global norm is at most `max_norm` (0: no clipping):
    torch.nn.utils.clip_grad_norm_'s arithmetic on the norm every stage's squares add up to."""
    if not max_norm > 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_squares) + CLIP_EPSILON))


def describe(options) -> str:
    """The recipe in one line: "adamw, lr 0.001 (warm-up 2, then cosine), weight decay 0.1, clipped at norm 1"."""
    shape = [f"warm-up {options.warmup}"] if options.warmup else []
    if options.lr_schedule != "constant":
        shape.append(f"{'then ' if shape else ''}{options.lr_schedule}")
    parts = [options.optimizer + (f" (momentum {options.momentum:g})" if options.optimizer == "sgd" else ""),
             f"lr {options.lr:g}" + (f" ({', '.join(shape)})" if shape else "")]  # fmt: skip
    if options.weight_decay:
        parts.append(f"weight decay {options.weight_decay:g}")
    if options.clip_grad_norm:
        parts.append(f"clipped at norm {options.clip_grad_norm:g}")
    if options.precision != "fp32":
        parts.append(options.precision)
    if options.lora:
        targets = f"the Linear layers {options.lora_targets!r} names" if options.lora_targets else "every Linear layer"
        parts.append(f"LoRA of rank {options.lora} on {targets}")
    if options.freeze:
        parts.append(f"frozen: the weights {options.freeze!r} names")
    if options.stop_on_divergence:
        parts.append("stops if it diverges")
    return ", ".join(parts)


def chance_loss(spec: ModelSpec) -> float | None:
    """The loss of guessing: ln(classes), or of the vocabulary for a language model (None with one class)."""
    return math.log(spec.num_classes) if spec.num_classes > 1 else None


DIVERGED_PAST_CHANCE = 1.05  # a held-out loss this many times chance's is past it (not an untrained model's noise)


def divergence(ev: dict, chance: float | None) -> str | None:
    """Why an `iteration` or `eval` event says the run diverged (its loss not finite; its held-out loss past
    chance), else None."""
    if ev.get("type") == "iteration" and ev.get("loss") is None:
        return "its training loss is not a number"
    if ev.get("type") == "eval":
        if ev.get("loss") is None:
            return "its held-out loss is not a number"
        if chance is not None and ev["loss"] > chance * DIVERGED_PAST_CHANCE:
            return f"its held-out loss {ev['loss']:.2f} is past chance's {chance:.2f}"
    return None


def check_freeze(pattern: str, what: str = "freeze") -> None:
    """UserError unless `pattern` is a regular expression."""
    if len(pattern) > 500:
        raise UserError(f"{what} must be a regular expression of at most 500 characters, got {len(pattern)}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UserError(f"{what}: {pattern!r} is no regular expression ({exc})") from None


def named_parameters(spec: ModelSpec, layers: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of the layers under the model's own name (as its state_dict and `--save` name it), once."""
    seen: set[int] = set()
    out = []
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name if spec.chain is not None else f"{i}.{name}", p))
    return out


def freeze(spec: ModelSpec, layers: list[nn.Module], pattern: str) -> list[str]:
    """Stop training the parameters whose name `pattern` finds (re.search; "" freezes nothing); returns their
    names. A pattern that names no parameter is an error (a typo would otherwise train everything)."""
    if not pattern:
        return []
    check_freeze(pattern)
    regex = re.compile(pattern)
    named = named_parameters(spec, layers)
    frozen = [name for name, p in named if regex.search(name) and not name.endswith((".lora_a", ".lora_b"))]
    if not frozen:
        few = ", ".join(n for n, _ in named[:4])
        raise UserError(f"freeze: {pattern!r} names no parameter of {spec.name} (its names are like {few})")
    for name, p in named:
        if name in frozen:
            p.requires_grad_(False)
    return frozen


def model_layers(spec: ModelSpec) -> list[nn.Module]:
    """The model's layers for their shapes: a zoo model's on the meta device (nothing allocated), a captured one's
    for real (a traced graph differs on the meta device)."""
    import contextlib

    import torch

    with torch.device("meta") if spec.chain is None else contextlib.nullcontext():
        return spec.layers()


def planned(w: Workload, options) -> Workload:
    """The workload to plan a run of `options` with (trained_workload of its model's layers, frozen as it says)."""
    from engine.models import get_model

    spec = get_model(w.model)
    layers = model_layers(spec)
    prepare(spec, layers, options)
    return trained_workload(w, layers, options)


def prepare(spec: ModelSpec, layers: list[nn.Module], options) -> None:
    """The model's layers as the run trains them: low-rank adapters where `options.lora` asks (engine.lora; the
    adapted weights frozen), then the weights `options.freeze` names frozen. Every process does the same."""
    from engine.lora import add_adapters

    add_adapters(spec, layers, options.lora, options.lora_targets)
    freeze(spec, layers, options.freeze)


def trained_workload(w: Workload, layers: list[nn.Module], options) -> Workload:
    """`w` as `options` trains it: each layer's optimizer state for its trained weights only, gradients and the
    all-reduce of trained weights only, and no weight-gradient work in a layer whose weights are all frozen.
    `layers` are the model's (shapes are enough), frozen as the run freezes them."""
    states = optimizer_states(options.optimizer, options.momentum)
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    trained = tuple(size(p for p in layer.parameters() if p.requires_grad) for layer in layers)
    if len(trained) != w.num_layers:
        return w  # a workload made up for another model (tests): as it is
    total = tuple(size(layer.parameters()) for layer in layers)
    share = w.weight_share or tuple(0.5 if p > 0 else 0.0 for p in w.param_bytes)
    backward = tuple(
        b * (1.0 - s) if all_ > 0 and t == 0 else b for b, s, t, all_ in zip(w.backward_flops, share, trained, total)
    )
    scale = [t / a if a else 1.0 for t, a in zip(trained, total)]  # the profile's bytes, the trained part of them
    if options.precision != "fp32" and w.value_bytes == 4:  # its cuts carry 16-bit floats: half the bytes
        w = replace(w, output_bytes=tuple(b // 2 for b in w.output_bytes), value_bytes=2)
    return replace(
        w,
        backward_flops=backward,
        trainable_bytes=tuple(round(p * s) for p, s in zip(w.param_bytes, scale)),
        optimizer_bytes=tuple(round(p * s) * states for p, s in zip(w.param_bytes, scale)),
        weight_share=tuple(0.0 if a > 0 and t == 0 else s for s, t, a in zip(share, trained, total)),
    )
