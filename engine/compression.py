"""Bit-level compression of the tensors crossing a link between pipeline stages (AccEPT).

    buf = encode(activation, 4)                      # one flat uint8 tensor, wire_bytes(shape, 4) long
    x = decode(buf, tuple(activation.shape), 4)      # float32, |x - activation| <= scale / 2 per channel
    feedback = ErrorFeedback()                       # gradients: carry each step's rounding error forward
    buf = feedback.encode((peer, slot), grad, 8)

Wire format at 8, 4 or 2 bits: G float32 minimums, then G float32 scales (native byte order,
little-endian on every host we run on), then the codes packed `8 // bits` to a byte, the first code in
the lowest bits, the last byte zero-padded. A value decodes to `min + code * scale`. G groups of
consecutive channels share a (min, scale): one group per channel when the header stays within
1/HEADER_SHARE of the codes, fewer (down to one for the whole tensor) when the tensor is too small for
that, so a compressed message is never much bigger than its codes. At OFF (32) the wire holds the raw
float32 bytes.

Gradients cross at `engine.plan.gradient_bits(level)`: at least 8 bits (activations tolerate fewer bits than
gradients do), rounded stochastically so they stay unbiased; the rounding is seeded per message, so a
replayed iteration sends the same bytes.

Non-finite input does not crash: a group holding any NaN or inf decodes to NaN throughout (its min
and scale are sent as NaN), so a diverging run shows up on the receiver instead of being clipped away.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.errors import UserError
from engine.plan import LEVELS, OFF  # the levels a plan's boundaries may have; OFF: uncompressed float32

_FORMS = "off, 8, 4, 2, auto or auto:8,4, each but off also as delta:… (e.g. delta:2)"
HEADER_SHARE = 16  # the (min, scale) header stays within 1/16 of the codes' bytes
DELTA = "delta:"  # the prefix that asks for activation-change compression (engine.deltas)


class Compression(NamedTuple):
    """What `--compression` asks for: the allowed levels (most lossless first; empty: off), whether the planner
    picks among them per boundary, and whether samples seen before send the change of their activation."""

    levels: tuple[int, ...]
    auto: bool
    delta: bool = False


def parse_compression(text: str) -> Compression:
    """`--compression` text -> what it asks for (`Compression`)."""
    form = text.strip().lower()
    delta = form.startswith(DELTA)
    if delta:
        form = form[len(DELTA) :].strip()
        if form == "off":
            raise UserError(f"compression {text!r}: delta needs a level to send changes at; use {_FORMS}")
    if form == "off":
        return Compression((), False)
    if form in {str(b) for b in LEVELS}:
        return Compression((int(form),), False, delta)
    if form == "auto":
        return Compression(LEVELS, True, delta)
    if form.startswith("auto:"):
        parts = [p.strip() for p in form[len("auto:") :].split(",")]
        if all(p in {str(b) for b in LEVELS} for p in parts):
            return Compression(tuple(sorted({int(p) for p in parts}, reverse=True)), True, delta)
    raise UserError(f"unknown compression {text!r}: use {_FORMS}")


def compression_text(allowed: tuple[int, ...], auto: bool, delta: bool = False) -> str:
    """Inverse of `parse_compression`: the `--compression` text of (allowed levels, auto, delta)."""
    if not allowed:
        return "off"
    if not auto:
        text = str(allowed[0])
    else:
        text = "auto" if tuple(allowed) == LEVELS else "auto:" + ",".join(map(str, allowed))
    return DELTA + text if delta else text


def plan_compression(compression: tuple[int, ...], delta: bool = False) -> str:
    """The `--compression` text a re-plan keeps for a plan of these boundary levels: its one level, or auto
    among its levels when they differ (with `delta`: sending changes, as the plan did)."""
    levels = tuple(sorted({b for b in compression if b < OFF}, reverse=True))
    return compression_text(levels, len(set(compression)) > 1, delta)


def _groups(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(outer, channels, inner): the tensor seen as (A, C, B), one (min, scale) pair per C.

    The channel is where value ranges differ most and which never depends on the micro-batch share
    (dim 0 does): dim 1 of a 4-D (n, C, H, W) conv activation (per-channel BN scale, ReLU), else the
    last dim, the features of (n, F) and the hidden dim of (n, T, D) transformer activations, where
    the few large "outlier" features live; per token (dim T) each token's range would be set by them.
    A 0-D or 1-D tensor is one channel. Channels are then grouped (`_scale_groups`) to bound the header.
    """
    if len(shape) < 2:
        return 1, 1, math.prod(shape)
    d = 1 if len(shape) == 4 else len(shape) - 1
    return math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :])


def _scale_groups(shape: tuple[int, ...], bits: int) -> tuple[int, int]:
    """(groups, channels per group): as many (min, scale) pairs as the header budget allows, at most one
    per channel; the last group may be short."""
    _, c, _ = _groups(shape)
    codes = -(-math.prod(shape) * bits // 8)
    groups = max(1, min(c, codes // (8 * HEADER_SHARE)))
    per = -(-c // groups)
    return -(-c // per), per


def _check_bits(bits: int) -> None:
    if bits not in (*LEVELS, OFF):
        raise ValueError(f"compression level must be one of {(*LEVELS, OFF)}, got {bits}")


def wire_bytes(shape: tuple[int, ...], bits: int) -> int:
    """Exact length of `encode(x, bits)` for a tensor of `shape`: what a receiver pre-allocates."""
    _check_bits(bits)
    numel = math.prod(shape)
    if bits == OFF:
        return numel * 4
    return 8 * _scale_groups(tuple(shape), bits)[0] + -(-numel * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes < 2**bits -> ceil(numel * bits / 8) bytes, `8 // bits` codes a byte, first lowest."""
    codes = codes.reshape(-1)
    per = 8 // bits
    if per == 1:
        return codes.contiguous()
    if codes.numel() % per:
        codes = torch.cat([codes, codes.new_zeros(per - codes.numel() % per)])
    columns = codes.view(-1, per)
    out = columns[:, 0].clone()
    for i in range(1, per):  # over the <= 4 slots of a byte, each a whole column: ~3x faster than a sum
        out |= columns[:, i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack`: the first `numel` codes, flat uint8."""
    per = 8 // bits
    if packed.numel() * per < numel:
        raise ValueError(f"{packed.numel()} bytes hold fewer than {numel} codes of {bits} bits")
    if per == 1:
        return packed[:numel]
    packed = packed.reshape(-1)
    out = torch.empty(packed.numel(), per, dtype=torch.uint8)
    for i in range(per):  # one column per slot of a byte, as in `pack`
        torch.bitwise_and(packed >> (i * bits), (1 << bits) - 1, out=out[:, i])
    return out.view(-1)[:numel]


def encode(
    x: torch.Tensor, bits: int, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`x` as one flat uint8 tensor of `wire_bytes(x.shape, bits)` bytes (see the module docstring).

    Codes round to nearest, or stochastically (unbiased: E[decode] == x) when `stochastic`.
    """
    _check_bits(bits)
    x = x.detach().to(torch.float32)
    if bits == OFF:  # a view of x's bytes when x is contiguous float32
        return x.contiguous().reshape(-1).view(torch.uint8)
    a, c, b = _groups(tuple(x.shape))
    g, per = _scale_groups(tuple(x.shape), bits)
    v = x.reshape(a, c, b)
    levels = (1 << bits) - 1
    if v.numel():
        lo, hi = v.amin(dim=(0, 2)), v.amax(dim=(0, 2))
        if per > 1:  # per group of channels: pad the last group with values that change nothing
            pad = g * per - c
            lo = torch.cat([lo, lo.new_full((pad,), math.inf)]).view(g, per).amin(dim=1)
            hi = torch.cat([hi, hi.new_full((pad,), -math.inf)]).view(g, per).amax(dim=1)
    else:
        lo = hi = v.new_zeros(g)
    scale = hi / levels - lo / levels  # not (hi - lo) / levels: that overflows for finite extremes
    finite = torch.isfinite(scale)  # NaN, +inf or -inf anywhere in the group
    if not bool(finite.all()):
        v = torch.where(_per_channel(finite, per, c)[:, None], v, 0.0)
        lo, scale = torch.where(finite, lo, 0.0), torch.where(finite, scale, math.nan)
    # A constant group (scale 0, or so small 1 / scale overflows) gets codes 0 and decodes to its min.
    inv = torch.where(scale >= torch.finfo(torch.float32).tiny, 1.0 / scale, 0.0)
    q = (v - _per_channel(lo, per, c)[:, None]).mul_(_per_channel(inv, per, c)[:, None])
    if stochastic:
        q = q.add_(torch.rand(q.shape, generator=generator)).floor_()
    else:
        q = q.round_()
    codes = q.clamp_(0, levels).to(torch.uint8)
    lo = torch.where(finite, lo, math.nan)
    return torch.cat([torch.cat([lo, scale]).view(torch.uint8), pack(codes, bits)])


def _per_channel(values: torch.Tensor, per: int, channels: int) -> torch.Tensor:
    """One value per group -> the group's value for each of its channels."""
    return values if per == 1 else values.repeat_interleave(per)[:channels]


def decode(buf: torch.Tensor, shape: tuple[int, ...], bits: int) -> torch.Tensor:
    """The float32 tensor of `shape` that `encode` wrote into `buf` (a new tensor: `buf` may be reused)."""
    shape = tuple(shape)
    if buf.numel() != wire_bytes(shape, bits):
        raise ValueError(f"{buf.numel()} bytes do not hold {shape} at {bits} bits ({wire_bytes(shape, bits)} do)")
    buf = buf.reshape(-1)
    if bits == OFF:
        return buf.clone().view(torch.float32).reshape(shape)
    a, c, b = _groups(shape)
    g, per = _scale_groups(shape, bits)
    header = buf[: 8 * g].clone().view(torch.float32)  # clone: buf's offset need not be 4-aligned
    lo, scale = _per_channel(header[:g], per, c)[:, None], _per_channel(header[g:], per, c)[:, None]
    codes = unpack(buf[8 * g :], bits, a * c * b).reshape(a, c, b)
    return codes.to(torch.float32).mul_(scale).add_(lo).reshape(shape)


@dataclass
class ErrorFeedback:
    """Error-feedback compression: what one step's rounding drops is added to the next step's tensor.

    Keep one per sender, keyed by whatever identifies a stream (e.g. (peer, micro-batch slot)); the sum
    of what the receiver decodes then tracks the sum of what was sent, the residual staying within one
    quantisation step. A residual whose shape no longer matches (after a re-plan) is dropped.
    """

    residuals: dict[Hashable, torch.Tensor] = field(default_factory=dict)

    def encode(self, key: Hashable, x: torch.Tensor, bits: int) -> torch.Tensor:
        x = x.detach().to(torch.float32)
        residual = self.residuals.get(key)
        target = x + residual if residual is not None and residual.shape == x.shape else x
        buf = encode(target, bits)
        # nan_to_num: a non-finite step must not poison every later one.
        self.residuals[key] = (target - decode(buf, tuple(x.shape), bits)).nan_to_num_(0.0, 0.0, 0.0)
        return buf

    def reset(self) -> None:
        self.residuals.clear()


def measure_codec(bits_levels: tuple[int, ...] = LEVELS, numel: int = 1 << 20, repeats: int = 5) -> dict[int, float]:
    """Host seconds per element of encode + decode at each level (median of `repeats`, torch on one thread),
    the mean of a round-to-nearest round trip (activations) and a stochastic one (gradients).

    The tensor is (numel // 64, 64) random normal: 64 channels, as an activation would have.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(max(1, numel // 64), 64, generator=torch.Generator().manual_seed(0))
        shape = tuple(x.shape)
        rng = torch.Generator().manual_seed(0)

        def round_trip(bits: int) -> None:
            decode(encode(x, bits), shape, bits)
            decode(encode(x, bits, stochastic=True, generator=rng), shape, bits)

        seconds = {}
        for bits in bits_levels:
            round_trip(bits)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                round_trip(bits)
                times.append(time.perf_counter() - start)
            seconds[bits] = statistics.median(times) / x.numel() / 2
        return seconds
    finally:
        torch.set_num_threads(threads)
