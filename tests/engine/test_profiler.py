"""Profiler: per-layer times, FLOPs and bytes match the real layers; profiles round-trip and cache."""

import io
import json

import pytest
import torch
from torch import nn

from engine import profiler
from engine.errors import UserError
from engine.models import ModelSpec, get_model
from engine.profiler import LayerProfile, ModelProfile, cache_path, cached_profile, host_id, profile_model
from engine.progress import Progress


@pytest.fixture(scope="module")
def mobilenet_profile():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_model(get_model("mobilenetv2"), micro_batch=2, repeats=1, warmup=0)
    finally:
        torch.set_num_threads(threads)


def tiny_spec():
    return ModelSpec(
        "tiny",
        "cnn",
        "classification",
        (8,),
        "float32",
        3,
        "two linear layers",
        lambda: [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)],
    )


def test_profile_matches_real_layers(mobilenet_profile):
    spec = get_model("mobilenetv2")
    p = mobilenet_profile
    layers = spec.layers()
    assert (p.model, p.micro_batch, p.optimizer) == ("mobilenetv2", 2, "sgd")
    assert p.device.startswith("host-") and "1thread-torch" in p.device
    assert len(p.layers) == len(layers) == 21
    assert p.input_bytes == 3 * 32 * 32 * 4
    assert p.layers[1].name == "1:InvertedResidual" and p.layers[0].name == "0:Conv2d+BatchNorm2d+ReLU6"
    x, _ = spec.example_batch(2)
    for layer, lp in zip(layers, p.layers):
        x = layer(x)
        assert lp.forward_s > 0 and lp.backward_s > 0
        assert lp.output_bytes == x[0].numel() * 4
        params = sum(t.numel() for t in layer.parameters())
        buffers = sum(t.numel() * t.element_size() for t in layer.buffers())
        assert lp.param_bytes == params * 4 + buffers
        assert lp.optimizer_bytes == params * 4
        assert lp.peak_bytes >= lp.output_bytes + lp.saved_bytes
    assert all(lp.flops > 0 for lp in p.layers if "Pool" not in lp.name)
    assert all(lp.saved_bytes > 0 for lp in p.layers[:19])  # every conv layer keeps activations
    assert p.total_flops > 0 and p.total_host_s > 0


def test_flops_of_a_linear_layer():
    p = profile_model(tiny_spec(), micro_batch=4, repeats=1, warmup=0)
    # Layer 0 gets data, so no input gradient: forward 2*8*16 plus weight gradient 2*8*16 per sample.
    assert p.layers[0].flops == 2 * 2 * 8 * 16
    # Layer 2 also sends the gradient of its input back: 3 matmuls of 2*16*3.
    assert p.layers[2].flops == 3 * 2 * 16 * 3
    assert p.layers[1].flops == 0 and p.layers[1].param_bytes == 0


def test_adam_doubles_optimizer_state():
    sgd = profile_model(tiny_spec(), micro_batch=2, repeats=1, warmup=0, optimizer="sgd")
    adam = profile_model(tiny_spec(), micro_batch=2, repeats=1, warmup=0, optimizer="adam")
    assert [a.optimizer_bytes for a in adam.layers] == [2 * s.optimizer_bytes for s in sgd.layers]
    assert sgd.layers[0].optimizer_bytes == (8 * 16 + 16) * 4
    with pytest.raises(UserError, match="unknown optimizer 'lamb'"):
        profile_model(tiny_spec(), optimizer="lamb")


def test_json_round_trip(mobilenet_profile):
    doc = json.loads(json.dumps(mobilenet_profile.to_dict()))
    assert ModelProfile.from_dict(doc) == mobilenet_profile
    assert isinstance(ModelProfile.from_dict(doc).layers[0], LayerProfile)


def test_host_id_is_filename_safe():
    assert host_id().startswith("host-") and all(c.isalnum() or c in "._-" for c in host_id())


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = profiler.profile_model

    def counting(*args, **kw):
        calls.append(args[0].name)
        return real(*args, **kw)

    monkeypatch.setattr(profiler, "profile_model", counting)
    return calls


def test_cache_hit_does_not_reprofile(tmp_path, counted):
    first = cached_profile(tiny_spec(), micro_batch=2, cache_dir=tmp_path, repeats=1, warmup=0)
    path = cache_path("tiny", 2, "sgd", tmp_path)
    assert path.is_file() and counted == ["tiny"]
    assert cached_profile(tiny_spec(), micro_batch=2, cache_dir=tmp_path) == first
    assert counted == ["tiny"]
    cached_profile(tiny_spec(), micro_batch=2, cache_dir=tmp_path, refresh=True, repeats=1, warmup=0)
    cached_profile(tiny_spec(), micro_batch=4, cache_dir=tmp_path, repeats=1, warmup=0)
    cached_profile(tiny_spec(), micro_batch=2, cache_dir=tmp_path, optimizer="adam", repeats=1, warmup=0)
    assert len(counted) == 4 and len(list(tmp_path.glob("*.json"))) == 3


@pytest.mark.parametrize("garbage", ["{not json", "[]", '{"version": 1, "layers": [{"name": 3}]}', ""])
def test_corrupt_cache_is_reprofiled(tmp_path, counted, garbage):
    path = cache_path("tiny", 2, "sgd", tmp_path)
    path.write_text(garbage)
    profile = cached_profile(tiny_spec(), micro_batch=2, cache_dir=tmp_path, repeats=1, warmup=0)
    assert counted == ["tiny"]
    assert ModelProfile.from_dict(json.loads(path.read_text())) == profile


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTEROID_CACHE_DIR", str(tmp_path / "c"))
    cached_profile(tiny_spec(), micro_batch=1, repeats=1, warmup=0)
    assert cache_path("tiny", 1).parent == tmp_path / "c" and cache_path("tiny", 1).is_file()


def test_progress_reports(capsys):
    profile_model(tiny_spec(), micro_batch=1, repeats=1, warmup=0, progress=True)
    assert "profiling tiny (micro-batch 1): 3/3 done" in capsys.readouterr().err
    profile_model(tiny_spec(), micro_batch=1, repeats=1, warmup=0)
    assert capsys.readouterr().err == ""


def test_progress_bar_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    with Progress(4, "work", stream=stream, width=4) as bar:
        bar.update(2, note="half")
    assert "work [##--] 2/4 half" in stream.getvalue() and "work: 2/4 done" in stream.getvalue()
