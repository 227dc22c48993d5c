"""How to train a plan: the one run configuration the CLI, the launcher, the agent and the web app share.

    options = RunOptions(iterations=20, dataset="cifar10", data_dir="data/cifar-10-batches-py")
    RunOptions.from_dict(options.to_dict()) == options      # what travels to an agent in `assign`

It validates itself on construction, so a bad value is one clear UserError wherever it came from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine.errors import UserError
from engine.schedule import SCHEDULES


@dataclass(frozen=True)
class RunOptions:
    """How to train a plan (what `python -m engine train` exposes)."""

    iterations: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    dataset: str = "synthetic"
    data_dir: str | None = None
    dataset_size: int = 2048
    emulate: bool = True
    dilation: float | None = None  # None: calibrated at start-up
    enforce_memory: bool = True
    timeout_s: float = 30.0
    save_model: bool = False  # the devices return their stages' weights at the end
    generation: int = 0  # the rendezvous store prefix `asteroid/gen<generation>/`
    eval_every: int = 0  # score the held-out split every this many iterations and after the last (0: never)
    eval_samples: int = 512  # at most this many held-out samples, in whole batches
    # the levels a re-plan may put on stage boundaries, as `--compression` takes them (None: the first plan's)
    compression: str | None = None
    # the pipeline schedule a re-plan may use: "auto" (the planner simulates each) or one of engine.schedule's
    schedule: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), _TYPES[f.name])
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
        if self.eval_every < 0:
            raise UserError(f"eval-every must be 0 (never) or more, got {self.eval_every}")
        if self.eval_samples < 1:
            raise UserError(f"eval samples must be at least 1, got {self.eval_samples}")
        if self.compression is not None:
            from engine.compression import parse_compression  # torch: only when it is needed

            parse_compression(self.compression)
        if self.schedule not in ("auto", *SCHEDULES):
            raise UserError(f"schedule must be auto, {', '.join(SCHEDULES)}; got {self.schedule!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Any) -> RunOptions:
        """Options from `to_dict()`'s form; missing keys take their defaults, unknown keys are an error."""
        if not isinstance(doc, dict):
            raise UserError(f"run options must be an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(_TYPES))
        if unknown:
            raise UserError(f"unknown run option(s): {', '.join(map(str, unknown))}")
        return cls(**doc)


# The value types each option accepts (None only where the default is None); ints are accepted as floats.
_TYPES: dict[str, tuple[type, ...]] = {
    "iterations": (int,),
    "lr": (float,),
    "momentum": (float,),
    "seed": (int,),
    "dataset": (str,),
    "data_dir": (str, type(None)),
    "dataset_size": (int,),
    "emulate": (bool,),
    "dilation": (float, type(None)),
    "enforce_memory": (bool,),
    "timeout_s": (float,),
    "save_model": (bool,),
    "generation": (int,),
    "eval_every": (int,),
    "eval_samples": (int,),
    "compression": (str, type(None)),
    "schedule": (str,),
}


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None and type(None) in types:
        return
    if bool in types:
        ok = isinstance(value, bool)
    elif int in types:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif float in types:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, types)
    if not ok:
        raise UserError(f"run option {name} must be {types[0].__name__}, got {value!r}")
