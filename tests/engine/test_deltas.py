"""Activation-change compression (engine.deltas): both ends of a pair hold the same copies, a change costs a
fraction of the activation's error, and the copies follow commits, failures and roll-backs exactly."""

import pytest
import torch

from engine.compression import decode, encode, wire_bytes
from engine.deltas import DeltaMemory

SHAPE = (16, 24)  # per sample: 16 tokens of 24 features


def _pair(cap=100, layer=5):
    return DeltaMemory(layer, cap), DeltaMemory(layer, cap)


def _cross(out, inn, samples, x, bits, k=None):
    buf = out.encode("b", samples, x, bits)
    assert buf.numel() == inn.wire_bytes("a", samples, SHAPE, bits)  # what the receiver pre-allocates
    got = inn.decode("a", samples, buf, SHAPE, bits)
    if k is not None:
        out.commit(k)
        inn.commit(k)
    return got


def _same(out, inn):
    assert {s for _, s in out.kept} == {s for _, s in inn.kept}
    for (_, s), v in out.kept.items():
        assert torch.equal(v, inn.kept[("a", s)])


def test_a_sample_seen_before_crosses_as_its_change_with_a_fraction_of_the_error():
    out, inn = _pair()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, *SHAPE, generator=g) * 3
    samples = list(range(100, 108))
    first = _cross(out, inn, samples, x, 2, k=0)
    direct = decode(encode(x, 2), (8, *SHAPE), 2)
    assert torch.equal(first, direct)  # first sight: the boundary's level, as without changes
    _same(out, inn)
    for k in range(1, 5):  # later epochs: the weights moved a little; each change also sends what was lost before
        moved = x + 0.01 * k * torch.randn(x.shape, generator=g)
        again = _cross(out, inn, samples, moved, 2, k=k)
    direct_error = (decode(encode(moved, 2), (8, *SHAPE), 2) - moved).abs().mean()
    delta_error = (again - moved).abs().mean()
    assert delta_error < direct_error / 5, (delta_error, direct_error)
    _same(out, inn)
    # the same bytes as a direct message of those rows: the gain is in what they carry
    assert out.wire_bytes("b", samples, SHAPE, 2) == wire_bytes((8, *SHAPE), 2)


def test_a_slice_of_old_and_new_samples_sends_each_its_own_way_and_the_receiver_agrees():
    out, inn = _pair()
    x = torch.randn(6, *SHAPE)
    _cross(out, inn, [1, 2, 3], x[:3], 4, k=0)
    mixed = [3, 9, 1, 7, 2, 8]  # three seen, three new, interleaved
    y = torch.randn(6, *SHAPE)
    got = _cross(out, inn, mixed, y, 4, k=1)
    assert inn.seen("a", [3, 9, 1]) == [True, True, True]
    assert got.shape == (6, *SHAPE) and (got - y).abs().max() < 1.0
    assert inn.wire_bytes("a", [3, 99], SHAPE, 4) == wire_bytes((1, *SHAPE), 4) * 2
    _same(out, inn)


def test_a_full_pair_sends_the_rest_directly_on_both_ends():
    out, inn = _pair(cap=3)
    x = torch.randn(5, *SHAPE)
    _cross(out, inn, [0, 1, 2, 3, 4], x, 8, k=0)
    assert len(out.kept) == len(inn.kept) == 3
    assert inn.seen("a", [0, 1, 2, 3, 4]) == [True, True, True, False, False]
    got = _cross(out, inn, [4, 3, 2], x[[4, 3, 2]], 8, k=1)
    assert len(out.kept) == 3 and (got - x[[4, 3, 2]]).abs().max() < 0.1
    _same(out, inn)


def test_a_failed_iteration_keeps_nothing_and_a_roll_back_restores_every_copy():
    out, inn = _pair(cap=100)
    g = torch.Generator().manual_seed(1)
    states = []
    for k in range(4):
        _cross(out, inn, [k % 2, 10 + k], torch.randn(2, *SHAPE, generator=g), 2, k=k)
        states.append({key: v.clone() for key, v in out.kept.items()})
    _cross(out, inn, [0, 50], torch.randn(2, *SHAPE, generator=g), 2)  # iteration 4 fails before its commit
    out.discard()
    inn.discard()
    assert out.kept.keys() == states[3].keys() and out.live == 4
    assert out.can_roll_back(1) and not out.can_roll_back(5)
    for memory in (out, inn):
        memory.roll_back(2)
    assert out.live == 2 and out.kept.keys() == states[1].keys()
    assert all(torch.equal(out.kept[key], states[1][key]) for key in states[1])
    _same(out, inn)
    assert out.count == {"b": len(states[1])}
    _cross(out, inn, [1, 12], torch.randn(2, *SHAPE, generator=g), 2, k=2)  # and it goes on from there
    _same(out, inn)


def test_what_can_be_rolled_back_is_bounded_and_forgetting_a_peer_forgets_its_samples():
    out = DeltaMemory(5, cap=4)
    for k in range(6):
        out.encode("b", [0, 1], torch.randn(2, *SHAPE), 8)  # each iteration replaces both copies
        out.commit(k)
    assert len(out.kept) == 2 and sum(len(r) for _, r in out.undo) <= 4  # two iterations' worth
    assert out.can_roll_back(4) and not out.can_roll_back(3) and out.can_roll_back(6)
    out.encode("c", [1], torch.randn(1, *SHAPE), 8)
    out.commit(6)
    out.keep_only({"c"})
    assert {p for p, _ in out.kept} == {"c"} and not out.can_roll_back(6) and out.can_roll_back(7)


def test_mismatches_are_errors_not_garbage():
    out, inn = _pair()
    buf = out.encode("b", [1, 2], torch.randn(2, *SHAPE), 4)
    with pytest.raises(ValueError, match="bytes do not hold"):
        inn.decode("a", [1, 2, 3], buf, SHAPE, 4)
    out.commit(0)
    with pytest.raises(ValueError, match="kept activations"):
        out.encode("b", [1], torch.randn(1, 3, 3), 4)
    with pytest.raises(ValueError, match="cannot commit"):
        out.commit(3)
    with pytest.raises(ValueError, match=">= 1 sample"):
        DeltaMemory(5, 0)
