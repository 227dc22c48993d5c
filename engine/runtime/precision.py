"""A device's numeric precision: autocast of its stage's forward (fp32 weights stay the master copy), what its cuts
carry (16-bit floats in a 16-bit run), and fp16's dynamic loss scale, which every stage agrees on each iteration.

    precision = Precision(options)                 # one per device, across generations (its scale is run state)
    precision.cuts(half_in, half_out)              # which of the stage's cuts carry floats that may be 16-bit
    with precision.autocast(): out = module(x)
    loss = precision.scaled(loss)                  # the last stage: times the loss scale (fp16)
    found = precision.overflowed(params)           # 1.0 when a gradient is not finite (fp16), summed over devices
    factor = precision.step(found_total)           # None: skip the step everywhere; else unscale by this

The scale follows torch.amp.GradScaler's rule (start 2^16, halve on an overflow, double after 2000 clean steps), but
from the agreed overflow of every stage, so that all stages skip or step together, and travels with the layers'
copies (`state()`/`restore()`), so a replay steps with the scale an uninterrupted run had.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INIT_SCALE, GROWTH, BACKOFF, GROWTH_INTERVAL = 2.0**16, 2.0, 0.5, 2000


class Precision:
    def __init__(self, options, device_type: str = "cpu") -> None:
        self.dtype = DTYPES[options.precision]
        self.device_type = device_type
        self.scaling = options.precision == "fp16"
        self.scale, self.clean = (INIT_SCALE, 0) if self.scaling else (1.0, 0)
        self.wire_in = self.wire_out = None

    def cuts(self, half_in: bool, half_out: bool) -> None:
        """The dtype each of the stage's cuts carries: the run's 16-bit one where the cut holds floats that may be
        rounded (not a cut whose values must stay exact, such as token ids), else float32 (None)."""
        self.wire_in = self.dtype if half_in else None
        self.wire_out = self.dtype if half_out else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scaling else loss

    def overflowed(self, params: list[torch.Tensor]) -> float:
        """1.0 when one of these gradients holds an inf or a NaN (fp16 only; else 0.0)."""
        if not self.scaling:
            return 0.0
        return float(any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params))

    def step(self, found: float) -> float | None:
        """After the agreement: None when some stage overflowed (every stage skips the step, the scale halves),
        else what the gradients are multiplied by to unscale them (the scale grows after GROWTH_INTERVAL)."""
        if not self.scaling:
            return 1.0
        if found > 0:
            self.scale, self.clean = self.scale * BACKOFF, 0
            return None
        factor = 1.0 / self.scale
        self.clean += 1
        if self.clean == GROWTH_INTERVAL:
            self.scale, self.clean = self.scale * GROWTH, 0
        return factor

    def state(self) -> torch.Tensor:
        """The scale's state, as the layers' copies carry it."""
        return torch.tensor([self.scale, float(self.clean)], dtype=torch.float64)

    def restore(self, state: torch.Tensor | None) -> None:
        """Take the scale of restored layers (None: a fresh run's)."""
        if self.scaling:
            self.scale, self.clean = (INIT_SCALE, 0) if state is None else (float(state[0]), int(state[1]))

    def to_wire(self, x: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
        return x if wire is None else x.to(wire)
