"""Compression of tensors on a link: error bounds, the wire format, stochastic rounding, error feedback."""

import math

import pytest
import torch

from engine.compression import (
    LEVELS,
    OFF,
    ErrorFeedback,
    compression_text,
    decode,
    encode,
    measure_codec,
    pack,
    parse_compression,
    plan_compression,
    unpack,
    wire_bytes,
)
from engine.errors import UserError


def _channel_dim(x: torch.Tensor) -> int | None:
    """The documented choice: dim 1 of (n, C, H, W), else the last dim; a 1-D tensor is one channel."""
    if x.dim() < 2:
        return None
    return 1 if x.dim() == 4 else x.dim() - 1


def _per_channel(x: torch.Tensor, reduce) -> torch.Tensor:
    """`reduce` over each channel, broadcast back to x's shape."""
    d = _channel_dim(x)
    if d is None:
        return reduce(x).expand_as(x)
    dims = tuple(i for i in range(x.dim()) if i != d)
    return reduce(x, dim=dims, keepdim=True).expand_as(x)


def _tensors() -> dict[str, torch.Tensor]:
    """Random tensors whose channels have very different ranges, so a per-tensor scale would fail the bound;
    each channel holds >= 512 values, enough for a scale of its own at every level."""
    conv = torch.randn(4, 6, 12, 12) * torch.logspace(-3, 2, 6).view(1, 6, 1, 1) + 5
    conv[:, 2] = 3.7  # a constant channel
    return {
        "1-D": torch.randn(101) * 3 - 1,
        "n,C,H,W": conv,
        "n,T,D": torch.randn(4, 128, 16) * torch.logspace(-2, 1, 16),
        "n,F": torch.randn(512, 12) * torch.logspace(-2, 2, 12),
        "single sample": torch.randn(1, 6, 24, 24) * torch.logspace(-2, 1, 6).view(1, 6, 1, 1),
        "one element": torch.tensor([2.5]),
    }


@pytest.mark.parametrize("bits", LEVELS)
@pytest.mark.parametrize("name", list(_tensors()))
def test_nearest_round_trip_is_within_half_a_step_of_each_channel(name, bits):
    x = _tensors()[name]
    lo, hi = _per_channel(x, torch.amin), _per_channel(x, torch.amax)
    step = (hi - lo) / (2**bits - 1)
    tiny = 4 * torch.finfo(torch.float32).eps * torch.maximum(lo.abs(), hi.abs())
    y = decode(encode(x, bits), tuple(x.shape), bits)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert ((y - x).abs() <= step / 2 + tiny).all()


def test_a_constant_channel_decodes_exactly_and_off_is_lossless():
    x = _tensors()["n,C,H,W"]
    for bits in LEVELS:
        assert torch.equal(decode(encode(x, bits), tuple(x.shape), bits)[:, 2], x[:, 2])
    assert torch.equal(decode(encode(x, OFF), tuple(x.shape), OFF), x)
    assert torch.equal(decode(encode(torch.zeros(3, 4), 2), (3, 4), 2), torch.zeros(3, 4))


@pytest.mark.parametrize("bits", LEVELS)
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 13, 1000, 1001])
def test_pack_unpack_is_lossless_including_odd_lengths(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel * bits / 8)
    assert torch.equal(unpack(packed, bits, numel), codes)


def test_pack_puts_the_first_code_in_the_lowest_bits():
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    assert pack(codes, 4).tolist() == [1 | 2 << 4, 3, 3]
    assert pack(codes, 8).tolist() == codes.tolist()


@pytest.mark.parametrize("bits", (*LEVELS, OFF))
def test_encode_writes_exactly_wire_bytes(bits):
    for x in _tensors().values():
        buf = encode(x, bits)
        assert buf.dtype == torch.uint8 and buf.dim() == 1
        assert buf.numel() == wire_bytes(tuple(x.shape), bits)
    assert wire_bytes((2, 3), OFF) == 24
    assert wire_bytes((2, 3), 8) == 8 + 6  # too small for a scale per channel: one (min, scale), then the codes
    assert wire_bytes((512, 3), 8) == 3 * 8 + 1536  # one per channel
    assert wire_bytes((5,), 2) == 8 + 2


@pytest.mark.parametrize("bits", LEVELS)
@pytest.mark.parametrize("shape", [(2, 1024), (1, 3072), (4, 768), (2, 128, 768), (1, 320, 7, 7), (3, 5)])
def test_small_tensors_share_scales_so_the_header_stays_small(shape, bits):
    """An (n, F) activation of a small micro-batch share would carry more header than codes with a scale
    per channel; channels then share scales in groups and the bound holds per group."""
    codes = math.ceil(math.prod(shape) * bits / 8)
    assert wire_bytes(shape, bits) <= codes + max(8, codes / 16)
    assert wire_bytes(shape, bits) < math.prod(shape) * 4
    x = torch.randn(shape) * torch.logspace(-2, 1, shape[-1])
    y = decode(encode(x, bits), shape, bits)
    whole = (x.amax() - x.amin()) / (2**bits - 1)  # a group is never wider than the whole tensor
    assert ((y - x).abs() <= whole / 2 + 1e-5).all()


def test_bytes_shrink_4_8_16_times_on_a_large_activation():
    x = torch.randn(8, 64, 32, 32)
    full = wire_bytes(tuple(x.shape), OFF)
    for bits, ratio in zip(LEVELS, (4, 8, 16)):
        assert full / encode(x, bits).numel() == pytest.approx(ratio, rel=0.01)


def test_decode_reads_a_misaligned_slice_and_rejects_a_wrong_length():
    x = torch.randn(3, 5)
    for bits in (*LEVELS, OFF):
        buf = encode(x, bits)
        wire = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])  # a receive buffer at offset 1
        assert torch.equal(decode(wire[1:], (3, 5), bits), decode(buf, (3, 5), bits))
        with pytest.raises(ValueError, match="bytes"):
            decode(buf[:-1], (3, 5), bits)
    with pytest.raises(ValueError, match="got 3"):
        wire_bytes((3, 5), 3)


def test_stochastic_rounding_is_unbiased():
    x = torch.randn(4, 16)
    nearest = (decode(encode(x, 2), (4, 16), 2) - x).abs().max()
    g = torch.Generator().manual_seed(1)
    mean = torch.stack([decode(encode(x, 2, stochastic=True, generator=g), (4, 16), 2) for _ in range(4000)]).mean(0)
    assert (mean - x).abs().max() < nearest / 10
    again = torch.Generator().manual_seed(1)
    first = encode(x, 2, stochastic=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(encode(x, 2, stochastic=True, generator=again), first)  # seeded: reproducible


def test_error_feedback_keeps_the_running_sums_within_half_a_step():
    feedback = ErrorFeedback()
    sent = received = plain = torch.zeros(8, 32, dtype=torch.float64)
    for _ in range(300):
        x = torch.randn(8, 32)
        target = x + (sent - received).float()  # what the stored residual should be
        step = (target.amax() - target.amin()) / 3  # 256 values: one scale for the whole tensor
        received = received + decode(feedback.encode("peer0", x, 2), (8, 32), 2)
        sent = sent + x
        plain = plain + decode(encode(x, 2), (8, 32), 2)
        assert ((sent - received).abs() <= step / 2 + 1e-4).all()  # bounded, every step
    assert (sent - received).abs().max() < (sent - plain).abs().max() / 4  # without feedback it drifts
    assert (sent - received).float().allclose(feedback.residuals["peer0"], atol=1e-4)


def test_error_feedback_keys_reset_and_shape_changes():
    feedback = ErrorFeedback()
    x = torch.randn(4, 6)
    feedback.encode(("peer", 0), x, 4)
    feedback.encode(("peer", 1), x * 2, 4)
    assert set(feedback.residuals) == {("peer", 0), ("peer", 1)}
    y = torch.randn(2, 6)  # a re-plan changed the share: the old residual no longer applies
    assert torch.equal(feedback.encode(("peer", 0), y, 4), encode(y, 4))
    feedback.reset()
    assert feedback.residuals == {}
    assert torch.equal(feedback.encode(("peer", 1), x, 4), encode(x, 4))


def test_non_finite_values_poison_only_their_channel():
    x = torch.randn(2, 5, 24, 24)
    x[0, 1, 0, 0] = math.nan
    x[1, 3, 2, 2] = math.inf
    y = decode(encode(x, 4, stochastic=True), tuple(x.shape), 4)
    assert y[:, 1].isnan().all() and y[:, 3].isnan().all()
    good = [0, 2, 4]
    assert (y[:, good] - x[:, good]).abs().max() < 1
    feedback = ErrorFeedback()
    feedback.encode("k", x, 4)
    assert feedback.residuals["k"].isfinite().all()  # one bad step does not poison the next


def test_parse_compression_forms():
    assert parse_compression("off") == ((), False, False)
    assert parse_compression("8") == ((8,), False, False)
    assert parse_compression("4") == ((4,), False, False)
    assert parse_compression(" 2 ") == ((2,), False, False)
    assert parse_compression("auto") == ((8, 4, 2), True, False)
    assert parse_compression("auto:8,4") == ((8, 4), True, False)
    assert parse_compression("auto:2,8") == ((8, 2), True, False)
    assert parse_compression("delta:2") == ((2,), False, True)
    assert parse_compression(" Delta:auto:4,2") == ((4, 2), True, True)
    assert parse_compression("delta:auto").delta and parse_compression("delta:auto").auto


@pytest.mark.parametrize(
    "text", ["3", "", "auto:3", "fast", "auto:", "8,4", "32", "delta:", "delta:3", "delta:delta:2"]
)
def test_parse_compression_rejects_nonsense(text):
    with pytest.raises(UserError, match="use off, 8, 4, 2, auto or auto:8,4"):
        parse_compression(text)


def test_measure_codec_returns_positive_seconds_per_element_and_restores_threads():
    torch.set_num_threads(2)
    seconds = measure_codec(numel=1 << 12, repeats=2)
    assert torch.get_num_threads() == 2
    assert set(seconds) == set(LEVELS)
    assert all(math.isfinite(s) and 0 < s < 1e-3 for s in seconds.values())


@pytest.mark.parametrize("text", ["off", "8", "4", "2", "auto", "auto:8,4", "auto:2", "delta:2", "delta:auto:8,4"])
def test_compression_text_is_the_inverse_of_parse(text):
    assert compression_text(*parse_compression(text)) == text


def test_a_re_plan_keeps_a_plan_files_levels():
    assert plan_compression(()) == "off"
    assert plan_compression((4, 4)) == "4"
    assert plan_compression((8, OFF, 2)) == "auto:8,2"
    assert plan_compression((4, 4), delta=True) == "delta:4"


def test_delta_off_is_a_clear_error():
    with pytest.raises(UserError, match="delta needs a level"):
        parse_compression("delta:off")


def test_run_options_carry_the_allowed_levels_and_reject_nonsense():
    from engine.runtime.options import RunOptions

    options = RunOptions(compression="auto:8,4")
    assert RunOptions.from_dict(options.to_dict()).compression == "auto:8,4"
    with pytest.raises(UserError, match="unknown compression"):
        RunOptions(compression="3")
