"""Dropout masks are a function of (seed, iteration, sample position, layer), not of how the batch is split."""

import pytest
import torch
from torch import nn

from engine.data import get_dataset
from engine.models import get_model
from engine.models.randomness import Dropout, mix, number_draws, sample_draws
from engine.runtime.batches import batch_indices, load
from tests.engine.runtime.helpers import reference_run


def tiny(p: float = 0.5) -> list[nn.Module]:
    """Three layers, the middle one holding two Dropouts; no batch statistics anywhere."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        nn.Sequential(Dropout(p), nn.Linear(16, 16), nn.Tanh(), Dropout(p)),
        nn.Linear(16, 4),
    ]
    number_draws(layers)
    return layers


def run(layers: list[nn.Module], x: torch.Tensor, seed: int, iteration: int, positions: range) -> torch.Tensor:
    with sample_draws(seed, iteration, positions):
        for layer in layers:
            x = layer(x)
    return x


def in_slices(layers: list[nn.Module], x: torch.Tensor, seed: int, iteration: int, bounds: list[int]) -> torch.Tensor:
    """The batch computed slice by slice, each slice under the global positions of its rows."""
    return torch.cat([run(layers, x[a:b], seed, iteration, range(a, b)) for a, b in zip(bounds, bounds[1:])])


def test_number_draws_keys_by_layer_index_and_rank_in_the_layer():
    layers = tiny()
    assert [m.key for layer in layers for m in layer.modules() if isinstance(m, Dropout)] == [(1, 0), (1, 1)]


def test_zoo_layers_and_sequential_have_keyed_dropouts():
    for name, expected in {"vgg16": [(34, 0), (37, 0)], "mobilenetv2": [(20, 0)]}.items():
        spec = get_model(name)
        layers = spec.layers()
        assert not any(isinstance(m, nn.Dropout) for layer in layers for m in layer.modules())
        keys = [m.key for layer in layers for m in layer.modules() if isinstance(m, Dropout)]
        assert keys == expected
        assert [m.key for m in spec.sequential().modules() if isinstance(m, Dropout)] == expected


@pytest.mark.parametrize("bounds", [[0, 3, 8], [0, 1, 5, 8], [0, 7, 8]])
def test_tiny_model_in_slices_equals_one_piece(bounds):
    layers = tiny()
    x = torch.randn(8, 8)
    whole = run(layers, x, 3, 5, range(0, 8))
    # Equal up to float rounding (BLAS sums differently for other batch sizes); another mask would differ by O(1).
    torch.testing.assert_close(in_slices(layers, x, 3, 5, bounds), whole, rtol=1e-5, atol=1e-6)
    # Not trivially so: the masks really drop something, and differ from eval mode.
    assert not torch.allclose(whole, run([layer.eval() for layer in layers], x, 3, 5, range(0, 8)))


def test_gradients_follow_the_same_masks():
    layers = tiny()
    x = torch.randn(6, 8)
    run(layers, x, 1, 2, range(0, 6)).square().sum().backward()
    whole = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    for a, b in [(0, 2), (2, 6)]:
        run(layers, x[a:b], 1, 2, range(a, b)).square().sum().backward()
    sliced = [p.grad for layer in layers for p in layer.parameters()]
    for g, h in zip(whole, sliced):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-6)


def test_vgg16_in_slices_equals_one_piece():
    # vgg16 has no BatchNorm, so with keyed dropout every sample is computed independently of the others.
    spec = get_model("vgg16")
    torch.manual_seed(0)
    layers = spec.layers()
    x, _ = spec.example_batch(6, torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = run(layers, x, 0, 4, range(0, 6))
        sliced = in_slices(layers, x, 0, 4, [0, 2, 3, 6])
        # Stages split differently: up to the second Dropout on the whole batch, the rest in slices.
        h = run(layers[:36], x, 0, 4, range(0, 6))
        staged = torch.cat([run(layers[36:], h[a:b], 0, 4, range(a, b)) for a, b in [(0, 4), (4, 6)]])
        other_iteration = run(layers, x, 0, 5, range(0, 6))
        evaluated = run([layer.eval() for layer in layers], x, 0, 4, range(0, 6))
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(staged, whole, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(other_iteration, whole)
    assert not torch.allclose(evaluated, whole)


def masks(seed: int, iteration: int, positions: range, p: float = 0.5, shape: tuple[int, ...] = (64,)) -> torch.Tensor:
    d = Dropout(p)
    number_draws([d])
    with sample_draws(seed, iteration, positions):
        return d(torch.ones(len(positions), *shape))


def test_mask_is_a_function_of_seed_iteration_and_position():
    base = masks(0, 0, range(0, 4))
    assert torch.equal(base, masks(0, 0, range(0, 4)))
    assert torch.equal(base[2:], masks(0, 0, range(2, 4)))  # row i of a slice is sample lo + i
    assert not torch.equal(base, masks(0, 1, range(0, 4)))  # another iteration
    assert not torch.equal(base, masks(1, 0, range(0, 4)))  # another seed
    assert not torch.equal(base[1:], masks(0, 0, range(0, 3)))  # another position
    assert len({tuple(row.tolist()) for row in base}) == 4  # every sample has its own mask


def test_two_dropouts_draw_different_masks():
    a, b = Dropout(0.5), Dropout(0.5)
    number_draws([nn.Sequential(a, b)])
    assert (a.key, b.key) == ((0, 0), (0, 1))
    with sample_draws(0, 0, range(0, 2)):
        assert not torch.equal(a(torch.ones(2, 64)), b(torch.ones(2, 64)))


def test_p_is_respected_and_kept_values_are_scaled():
    for p in (0.1, 0.5, 0.8):
        out = masks(7, 3, range(10, 42), p=p, shape=(50, 50))
        dropped = (out == 0).float().mean().item()
        assert abs(dropped - p) < 0.01, (p, dropped)
        kept = out[out != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    assert torch.equal(masks(0, 0, range(0, 3), p=1.0), torch.zeros(3, 64))


def test_eval_mode_and_p_zero_are_the_identity():
    x = torch.randn(4, 10)
    d = Dropout(0.5).eval()
    number_draws([d])
    with sample_draws(0, 0, range(0, 4)):
        assert d(x) is x
        assert Dropout(0.0)(x) is x  # no key needed when nothing is drawn
    assert d(x) is x


def test_outside_a_context_it_is_plain_dropout_from_the_global_rng():
    x = torch.randn(16, 32)
    torch.manual_seed(5)
    expected = nn.Dropout(0.3)(x)
    torch.manual_seed(5)
    assert torch.equal(Dropout(0.3)(x), expected)  # no key needed either


def test_mismatching_positions_raise():
    d = Dropout(0.5)
    number_draws([d])
    with sample_draws(0, 0, range(0, 3)), pytest.raises(ValueError, match="covers 3 samples .* shape \\(4, 8\\)"):
        d(torch.ones(4, 8))


def test_a_dropout_without_key_raises_inside_a_context():
    with sample_draws(0, 0, range(0, 2)), pytest.raises(RuntimeError, match="call number_draws"):
        Dropout(0.5)(torch.ones(2, 8))


def test_contexts_nest_and_unwind_on_error():
    d = Dropout(0.5)
    number_draws([d])
    x = torch.ones(2, 64)
    with sample_draws(0, 0, range(0, 2)):
        outer = d(x)
        with sample_draws(0, 1, range(0, 2)):
            assert not torch.equal(d(x), outer)
        assert torch.equal(d(x), outer)
        with pytest.raises(ValueError), sample_draws(0, 0, range(0, 5)):
            d(x)
        assert torch.equal(d(x), outer)


def test_mix_is_stable_and_63_bit():
    # Fixed values: the same in every process and every run (no Python hash randomisation).
    assert mix(0, 0, 0, 0, 0) == 1089858482195386065
    assert mix(1, 2, 3, 4, 5) == 494455172797481550
    assert all(0 <= mix(s, -1, 2**70) < 2**63 for s in range(100))
    assert len({mix(s, k, i, 3, 0) for s in range(3) for k in range(3) for i in range(64)}) == 3 * 3 * 64
    assert mix(1, 2) != mix(2, 1)


def test_reference_run_equals_micro_batches_in_slices_at_their_global_positions():
    # What the runtime does: micro-batch m of k, rows lo:hi of it, under range(mb*m + lo, mb*m + hi).
    batch, micro_batches, iterations, lr = 8, 2, 2, 0.01
    _, expected = reference_run("vgg16", batch, iterations, lr)
    spec, mb = get_model("vgg16"), batch // micro_batches
    torch.manual_seed(0)
    net = spec.sequential()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    data = get_dataset("synthetic", spec, size=2048, seed=0)
    for k in range(iterations):
        x, y = load(data, batch_indices(len(data), batch, 0, k))
        for m in range(micro_batches):
            for lo, hi in [(0, 1), (1, mb)]:
                a, b = mb * m + lo, mb * m + hi
                with sample_draws(0, k, range(a, b)):
                    out = net(x[a:b])
                (spec.loss(out, y[a:b]) * (b - a) / batch).backward()
        opt.step()
        opt.zero_grad()
    for key, value in expected.items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=1e-5, atol=1e-5, msg=key)
