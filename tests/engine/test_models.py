"""Model zoo: every model builds, runs, trains a little, and is a faithful list of layers."""

import math

import pytest
import torch

from engine.errors import UserError
from engine.models import MODELS, ModelSpec, get_model, model_names

EXPECTED = {
    "mobilenetv2",
    "mobilenetv2-224",
    "resnet50",
    "resnet50-224",
    "vgg16",
    "vgg16-224",
    "bert-small",
    "gpt-small",
}


def expected_output_shape(spec: ModelSpec, n: int) -> tuple:
    if spec.task == "language-modeling":
        return (n, spec.input_shape[0], spec.num_classes)
    return (n, spec.num_classes)


def test_registry():
    assert set(model_names()) == EXPECTED == set(MODELS)
    assert get_model("mobilenetv2") is MODELS["mobilenetv2"]
    with pytest.raises(UserError, match=r"unknown model 'alexnet'; known models: .*mobilenetv2.*gpt-small"):
        get_model("alexnet")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_forward_loss_backward(name):
    spec = get_model(name)
    model = spec.sequential()
    x, y = spec.example_batch(2)
    assert tuple(x.shape) == (2, *spec.input_shape) and x.dtype == spec.dtype
    out = model(x)
    assert tuple(out.shape) == expected_output_shape(spec, 2)
    loss = spec.loss(out, y)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layers_one_by_one_equal_sequential(name):
    spec = get_model(name)
    torch.manual_seed(1)
    model = spec.sequential().eval()
    torch.manual_seed(1)
    layers = [layer.eval() for layer in spec.layers()]
    x, _ = spec.example_batch(2)
    with torch.no_grad():
        h = x
        for layer in layers:
            h = layer(h)
            assert isinstance(h, torch.Tensor)
        assert torch.equal(h, model(x))


def test_layer_counts():
    counts = {name: len(spec.layers()) for name, spec in MODELS.items()}
    assert counts == {
        "mobilenetv2": 21,
        "mobilenetv2-224": 21,
        "resnet50": 20,
        "resnet50-224": 21,
        "vgg16": 39,
        "vgg16-224": 39,
        "bert-small": 10,
        "gpt-small": 15,
    }
    for name, spec in MODELS.items():
        assert counts[name] >= (18 if spec.family == "cnn" else 8)


def test_reference_parameter_counts():
    # The 224 variants match the published models: 3.50M, 25.56M and 138.36M parameters.
    params = {
        n: sum(p.numel() for p in get_model(n).sequential().parameters()) for n in ("mobilenetv2-224", "resnet50-224")
    }
    assert params == {"mobilenetv2-224": 3_504_872, "resnet50-224": 25_557_032}


def test_vgg16_has_no_batchnorm():
    layers = get_model("vgg16").layers()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for layer in layers for m in layer.modules())
    assert sum(isinstance(layer, torch.nn.Conv2d) for layer in layers) == 13


def test_language_model_targets_are_next_tokens():
    x, y = get_model("gpt-small").example_batch(3)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_gpt_is_causal():
    spec = get_model("gpt-small")
    model = spec.sequential().eval()
    x, _ = spec.example_batch(1)
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % spec.vocab_size
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :-1], model(x2)[:, :-1], atol=1e-5)


def test_example_batch_uses_generator():
    spec = get_model("bert-small")
    a = spec.example_batch(2, torch.Generator().manual_seed(5))
    b = spec.example_batch(2, torch.Generator().manual_seed(5))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("name", ["mobilenetv2", "gpt-small"])
def test_sgd_lowers_loss(name):
    spec = get_model(name)
    model = spec.sequential()
    x, y = spec.example_batch(4 if spec.family == "cnn" else 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.02 if spec.family == "cnn" else 0.05, momentum=0.9)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
