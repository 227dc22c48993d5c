"""How to train a plan: the one run configuration the CLI, the launcher, the agent and the web app share.

    options = RunOptions(iterations=20, dataset="cifar10", data_dir="data/cifar-10-batches-py")
    RunOptions.from_dict(options.to_dict()) == options      # what travels to an agent in `assign`

It validates itself on construction, so a bad value is one clear UserError wherever it came from.

The options a job's owner chooses are declared with `option(...)`: label, help and bounds. The site's job form
(its fields, its API, what a job stores in `Job.options`) and `python -m engine train`'s flags follow from
`settable()`, so a new one is a field here and the code that uses it.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from engine.errors import UserError
from engine.fields import schema, wrong
from engine.recipe import LR_SCHEDULE_CHOICES, OPTIMIZER_CHOICES, PRECISION_CHOICES, check_freeze
from engine.schedule import SCHEDULES


def option(default: Any, label: str, help: str, low: float | None = None, high: float | None = None,
           choices: tuple[tuple[str, str], ...] | None = None) -> Any:  # fmt: skip
    """A run option a job's owner sets: the form field and the CLI flag are made from this (`settable()`).
    `low`/`high` bound a number; `choices` are (value, label) pairs."""
    return field(default=default, metadata={"label": label, "help": help, "low": low, "high": high,
                                            "choices": choices})  # fmt: skip


_SCHEDULE_LABELS = {
    "1f1b": "1F1B",
    "zb-h1": "ZB-H1 (zero bubble, 1F1B's memory)",
    "zb-h2": "ZB-H2 (zero bubble, more activations held)",
}
DEVICE_CHOICES = (
    ("auto", "auto (each board's GPU when it has one, else its CPU)"),
    ("cpu", "CPU"),
    ("cuda", "CUDA GPU (a board without one cannot run)"),
)
SCHEDULE_CHOICES = (("auto", "auto (the fastest simulated that fits)"), *((s, _SCHEDULE_LABELS[s]) for s in SCHEDULES))


@dataclass(frozen=True)
class RunOptions:
    """How to train a plan (what `python -m engine train` exposes)."""

    iterations: int = 10
    optimizer: str = option(
        "sgd", "Optimizer", "the optimizer of every stage (torch's betas and eps for Adam and AdamW)",
        choices=OPTIMIZER_CHOICES,
    )  # fmt: skip
    lr: float = option(0.05, "Learning rate", "the peak learning rate (after the warm-up)", 1e-6, 10.0)
    momentum: float = option(0.9, "Momentum", "SGD's momentum (Adam and AdamW do not use it)", 0.0, 0.999)
    weight_decay: float = option(
        0.0, "Weight decay", "weight decay of every weight but biases and norms (AdamW: decoupled from the gradient; "
        "SGD and Adam: added to it)", 0.0, 10.0,
    )  # fmt: skip
    lr_schedule: str = option(
        "constant", "Learning-rate schedule", "how the learning rate moves after the warm-up",
        choices=LR_SCHEDULE_CHOICES,
    )  # fmt: skip
    warmup: int = option(
        0, "Warm-up (iterations)", "the learning rate rises linearly to its peak over this many iterations", 0, 10**6
    )
    clip_grad_norm: float = option(
        0.0, "Clip gradient norm", "scale the gradients down when their global norm (every stage, every copy) is "
        "above this; 0: never", 0.0, 1e6,
    )  # fmt: skip
    freeze: str = option(
        "", "Freeze", "train no parameter whose name this regular expression finds (re.search), e.g. "
        "'^(embed|blocks\\.[0-5]\\.)'; empty: train every one",
    )  # fmt: skip
    precision: str = option(
        "fp32", "Precision", "the numbers each stage computes and its cuts carry: 16-bit autocast with float32 master "
        "weights; fp16 with a loss scale every stage agrees on (bf16 needs none)", choices=PRECISION_CHOICES,
    )  # fmt: skip
    device: str = option(
        "auto", "Compute device", "where each board computes its stage: its CUDA GPU when torch sees one there (auto), "
        "its CPU, or its GPU only (cuda)", choices=DEVICE_CHOICES,
    )  # fmt: skip
    lora: int = option(
        0, "LoRA rank", "train low-rank adapters of this rank on Linear layers instead of their weights, merged into "
        "them when the model is saved; 0: none", 0, 1024,
    )  # fmt: skip
    lora_targets: str = option(
        "", "LoRA targets", "a regular expression: the Linear layers (by name) that get adapters, e.g. 'qkv|proj'; "
        "empty: every one",
    )  # fmt: skip
    stop_on_divergence: bool = option(
        False, "Stop on divergence", "end the run when its loss is not a number or its held-out loss passes chance "
        "(it is said either way)",
    )  # fmt: skip
    seed: int = option(0, "Seed", "the seed of the weights and of the batch order", 0, 2**31 - 1)
    init: str | None = None  # a state_dict file (the model's own keys) the weights start from, else the seed's
    dataset: str = "synthetic"
    data_dir: str | None = None
    dataset_size: int = 2048
    emulate: bool = True
    dilation: float | None = None  # None: calibrated at start-up
    enforce_memory: bool = True
    timeout_s: float = 30.0
    save_model: bool = False  # the devices return their stages' weights at the end
    generation: int = 0  # the rendezvous store prefix `asteroid/gen<generation>/`
    eval_every: int = option(
        0, "Evaluate every (iterations)", "score the held-out split every N iterations and after the last; 0: never",
        0, 100_000,
    )  # fmt: skip
    eval_samples: int = 512  # at most this many held-out samples, in whole batches
    # each device reports the steps of at most one iteration per this many real seconds (0: of every iteration):
    # a site watching many boards whose iterations take a tenth of a second needs no more for its timelines
    steps_every_s: float = 0.0
    # the levels a re-plan may put on stage boundaries, as `--compression` takes them (None: the first plan's)
    compression: str | None = None
    # the pipeline schedule, of the first plan and of every re-plan: auto simulates each and keeps the fastest
    schedule: str = option(
        "auto", "Schedule", "how each stage orders its forward and backward steps; the zero-bubble schedules split "
        "the backward to fill the pipeline's idle time", choices=SCHEDULE_CHOICES,
    )  # fmt: skip

    def reports_steps(self, k: int, start: int, iteration_s: float) -> bool:
        """Whether the devices report iteration k's steps, when an iteration takes `iteration_s` real seconds:
        every iteration, or one in n (from the generation's first) so that one iteration's steps go out per
        `steps_every_s`. Every device of the generation computes the same."""
        if self.steps_every_s <= 0 or not iteration_s > 0:
            return True
        return (k - start) % max(1, math.floor(self.steps_every_s / iteration_s)) == 0

    def __post_init__(self) -> None:
        for name, (types, _) in schema(RunOptions).items():
            why = wrong(getattr(self, name), types)
            if why:
                raise UserError(f"run option {name} {why}")
        if self.iterations < 1:
            raise UserError(f"iterations must be at least 1, got {self.iterations}")
        if not self.lr > 0:
            raise UserError(f"learning rate must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise UserError(f"momentum must be in [0, 1), got {self.momentum}")
        if not self.timeout_s > 0:
            raise UserError(f"timeout must be positive, got {self.timeout_s}")
        if self.dilation is not None and not self.dilation > 0:
            raise UserError(f"dilation must be positive, got {self.dilation}")
        if self.dataset_size < 1:
            raise UserError(f"dataset size must be at least 1, got {self.dataset_size}")
        if self.generation < 0:
            raise UserError(f"generation must not be negative, got {self.generation}")
        if self.warmup > self.iterations:
            raise UserError(f"warm-up must be at most the run's {self.iterations} iterations, got {self.warmup}")
        check_freeze(self.freeze)
        check_freeze(self.lora_targets, "lora targets")
        if self.eval_every < 0:
            raise UserError(f"eval-every must be 0 (never) or more, got {self.eval_every}")
        if not (self.steps_every_s >= 0 and math.isfinite(self.steps_every_s)):
            raise UserError(f"steps-every must be 0 (every iteration) or more seconds, got {self.steps_every_s}")
        if self.eval_samples < 1:
            raise UserError(f"eval samples must be at least 1, got {self.eval_samples}")
        if self.compression is not None:
            from engine.compression import parse_compression  # torch: only when it is needed

            parse_compression(self.compression)
        for name, spec in settable().items():  # what the declarations bound
            value, low, high = getattr(self, name), spec["low"], spec["high"]
            allowed = [c for c, _ in spec["choices"] or ()]
            if allowed and value not in allowed:
                raise UserError(f"{name.replace('_', ' ')} must be one of {', '.join(allowed)}; got {value!r}")
            if low is not None and not low <= value <= high:
                raise UserError(f"{name.replace('_', ' ')} must be from {_show(low)} to {_show(high)}, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> RunOptions:
        """Options from `to_dict()`'s form; missing keys take their defaults, unknown keys are an error."""
        if not isinstance(doc, dict):
            raise UserError(f"run options must be an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(schema(cls)))
        if unknown:
            raise UserError(f"unknown run option(s): {', '.join(map(str, unknown))}")
        return cls(**doc)


def settable() -> dict[str, dict]:
    """The options a job's owner sets, by name: {"type", "default", "label", "help", "low", "high", "choices"}.
    (Looked up on every call, so a field added to RunOptions shows at once.)"""
    types = schema(RunOptions)
    return {
        f.name: {"type": types[f.name][0][0], "default": f.default, **f.metadata}
        for f in fields(RunOptions)
        if f.metadata and f.default is not MISSING
    }


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
