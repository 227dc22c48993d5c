"""Per-layer profiles: host time, FLOPs and memory of each layer at a micro-batch size, cached as JSON.

profile = cached_profile("mobilenetv2", micro_batch=8, progress=True)
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, fields
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from engine.errors import UserError
from engine.models import ModelSpec, get_model, layer_name
from engine.progress import Progress

# Bump when the measurement changes, so old cache files are re-profiled.
PROFILE_VERSION = 2
# Optimizer state per trainable parameter, in parameter sizes: SGD momentum buffer; Adam's two moments.
OPTIMIZER_STATES = {"sgd": 1, "adam": 2}


@dataclass(frozen=True)
class LayerProfile:
    """One layer at the profiled micro-batch. Times, FLOPs and activation bytes are per sample.

    forward_s/backward_s: median host seconds / micro_batch; backward is this layer's alone, given its
    output gradient. weight_s: the part of backward_s that computes the weight gradients (the whole backward
    less one that computes the input gradient alone; all of it for layer 0, which sends no gradient back).
    flops: forward + backward (FlopCounterMode: matmuls, convolutions; elementwise ops, pooling, norms and
    embedding lookups count 0). saved_bytes: storages autograd keeps for backward,
    deduplicated, parameters excluded. peak_bytes (estimate): input + output + saved + output grad +
    input grad (the latter only when the layer sends a gradient back, i.e. not for layer 0).
    """

    name: str
    forward_s: float
    backward_s: float
    flops: float
    output_bytes: int
    saved_bytes: int
    param_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    weight_s: float = 0.0


@dataclass(frozen=True)
class ModelProfile:
    """Every layer of one model, profiled on one host."""

    model: str
    micro_batch: int
    device: str
    optimizer: str
    input_bytes: int
    layers: tuple[LayerProfile, ...]

    @property
    def total_flops(self) -> float:
        """Forward+backward FLOPs per sample of the whole model."""
        return sum(layer.flops for layer in self.layers)

    @property
    def total_host_s(self) -> float:
        """Forward+backward host seconds per sample of the whole model."""
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self), "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> ModelProfile:
        """Parse `to_dict()` output; ValueError (or KeyError/TypeError) on anything malformed or outdated."""
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, expected {PROFILE_VERSION}")
        types = {f.name: f.type for f in fields(LayerProfile)}
        layers = tuple(
            LayerProfile(
                **{
                    k: str(v) if types[k] == "str" else float(v) if types[k] == "float" else int(v)
                    for k, v in layer.items()
                }
            )
            for layer in d["layers"]
        )
        profile = cls(
            str(d["model"]), int(d["micro_batch"]), str(d["device"]), str(d["optimizer"]), int(d["input_bytes"]), layers
        )
        if profile.micro_batch < 1 or not layers:
            raise ValueError("profile needs a positive micro_batch and at least one layer")
        return profile


def host_id(device: str = "cpu") -> str:
    """This host as a filename-safe id: CPU model and torch version (profiles run on one thread), or on a GPU its
    name and torch's CUDA version."""
    if device != "cpu":
        name = torch.cuda.get_device_name(torch.device(device))
        raw = f"gpu-{name}-cuda{torch.version.cuda}-torch{torch.__version__}"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-")
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1]
                break
    except OSError:
        pass
    raw = f"host-{cpu.strip()}-1thread-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-")


def _state_bytes(layer: nn.Module) -> tuple[int, int]:
    """(parameter + buffer bytes, trainable parameter bytes)."""
    params = sum(t.numel() * t.element_size() for t in chain(layer.parameters(), layer.buffers()))
    trainable = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    return params, trainable


def _conv_backward_flops(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _output_padding,
    _groups,
    output_mask,
    out_shape=None,
    **kwargs,
) -> int:
    """Input and weight gradients each cost what the forward convolution costs.

    Replaces torch's formula, whose weight-gradient term ignores `groups` and so counts a depthwise
    convolution (MobileNetV2) `groups` times over.
    """
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


FLOP_FORMULAS = {torch.ops.aten.convolution_backward: _conv_backward_flops}


def _counted_pass(layer: nn.Module, x: Tensor) -> tuple[float, int]:
    """One forward+backward: (FLOPs, bytes autograd saves), saved tensors deduplicated by storage.

    Parameters and buffers that autograd saves are not counted: they are in param_bytes already.
    """
    own = {t.untyped_storage().data_ptr() for t in chain(layer.parameters(), layer.buffers())}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        with saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        if y.requires_grad:
            y.backward(torch.ones_like(y))
    return float(counter.get_total_flops()), sum(saved.values())


def _clock(device: torch.device):
    """A timestamp function for work on `device`: on a GPU, after the work queued so far has run (synchronised)."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.perf_counter


def _time_layer(layer: nn.Module, x: Tensor, repeats: int, warmup: int) -> tuple[float, float, float, Tensor]:
    """Median forward, backward and input-gradient-only backward seconds (whole micro-batch; the last is the
    whole backward where the input takes no gradient), and the layer's output. On a GPU each part is timed from
    when the work before it has finished to when its own has (not when its kernels were queued)."""
    forward, backward, input_only = [], [], []
    grad = None
    clock = _clock(x.device)
    for r in range(warmup + repeats):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        t0 = clock()
        y = layer(x)
        t1 = clock()
        if y.requires_grad:
            if grad is None:
                grad = torch.randn_like(y)
            y.backward(grad, retain_graph=x.requires_grad)
        t2 = clock()
        if x.requires_grad:
            torch.autograd.grad(y, x, grad)  # autograd skips the weight gradients nobody asked for
        t3 = clock()
        if r >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            input_only.append(t3 - t2 if x.requires_grad else t2 - t1)
    return statistics.median(forward), statistics.median(backward), statistics.median(input_only), y.detach()


def _profile_layer(
    index: int, layer: nn.Module, x: Tensor, micro_batch: int, repeats: int, warmup: int, optimizer: str
) -> tuple[LayerProfile, Tensor]:
    # Layer 0 gets data (no input gradient); later layers get activations whose gradient is sent back.
    x = x.detach().requires_grad_(index > 0 and x.is_floating_point())
    flops, saved = _counted_pass(layer, x)
    forward_s, backward_s, input_s, y = _time_layer(layer, x, repeats, warmup)
    params, trainable = _state_bytes(layer)
    in_bytes = x.numel() * x.element_size() // micro_batch
    out_bytes = y.numel() * y.element_size() // micro_batch
    saved_bytes = saved // micro_batch
    # Peak estimate while this layer trains: input, output, saved tensors, output grad and input grad.
    peak = in_bytes + out_bytes + saved_bytes + out_bytes + (in_bytes if x.requires_grad else 0)
    profile = LayerProfile(
        name=layer_name(index, layer),
        forward_s=forward_s / micro_batch,
        backward_s=backward_s / micro_batch,
        flops=flops / micro_batch,
        output_bytes=out_bytes,
        saved_bytes=saved_bytes,
        param_bytes=params,
        optimizer_bytes=trainable * OPTIMIZER_STATES[optimizer],
        peak_bytes=peak,
        weight_s=(backward_s if not x.requires_grad else max(0.0, backward_s - input_s)) / micro_batch,
    )
    return profile, y


def profile_model(
    spec: ModelSpec,
    micro_batch: int = 8,
    repeats: int = 5,
    warmup: int = 2,
    optimizer: str = "sgd",
    progress: bool = False,
    device: str = "cpu",
) -> ModelProfile:
    """Profile every layer of `spec` in training mode on the input it really receives at `micro_batch`, on `device`
    ("cpu", or "cuda": the GPU's times, for a board that computes there)."""
    if micro_batch < 1 or repeats < 1 or warmup < 0:
        raise UserError(
            f"profiling needs micro_batch >= 1, repeats >= 1, warmup >= 0; got {micro_batch}, {repeats}, {warmup}"
        )
    if optimizer not in OPTIMIZER_STATES:
        raise UserError(f"unknown optimizer {optimizer!r}; known optimizers: {', '.join(OPTIMIZER_STATES)}")
    # A fixed seed makes profiles repeatable without disturbing the caller's RNG. One thread: on a small
    # shared host, two threads contending with other processes make timings swing by an order of magnitude.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _profile(spec, micro_batch, repeats, warmup, optimizer, progress, torch.device(device))
    finally:
        torch.set_num_threads(threads)


def _profile(
    spec: ModelSpec, micro_batch: int, repeats: int, warmup: int, optimizer: str, progress: bool, device: torch.device
) -> ModelProfile:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [layer.to(device) for layer in spec.layers()]
        x, _ = spec.example_batch(micro_batch)
        x = x.to(device)
        profiles = []
        with Progress(len(layers), f"profiling {spec.name} (micro-batch {micro_batch})", progress) as bar:
            input_bytes = x.numel() * x.element_size() // micro_batch
            for i, layer in enumerate(layers):
                layer.train()
                profile, x = _profile_layer(i, layer, x, micro_batch, repeats, warmup, optimizer)
                profiles.append(profile)
                bar.update(note=profile.name)
    return ModelProfile(spec.name, micro_batch, host_id(device.type), optimizer, input_bytes, tuple(profiles))


def default_cache_dir() -> Path:
    """`$ASTEROID_CACHE_DIR`, else ~/.cache/asteroid/profiles."""
    env = os.environ.get("ASTEROID_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asteroid" / "profiles"


def cache_path(
    model: str, micro_batch: int, optimizer: str = "sgd", cache_dir: str | Path | None = None, device: str = "cpu"
) -> Path:
    """Where the profile of `model` at `micro_batch` with `optimizer` on this host (its CPU or GPU) is cached."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory / f"{model}-mb{micro_batch}-{optimizer}-{host_id(device)}.json"


def cached_profile(
    name_or_spec: str | ModelSpec,
    micro_batch: int = 8,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
    progress: bool = False,
    optimizer: str = "sgd",
    device: str = "cpu",
    **kw,
) -> ModelProfile:
    """The cached profile if there is a valid one, else a fresh one (written back atomically).

    `kw` goes to `profile_model` (repeats, warmup). A corrupt or outdated cache file is re-profiled.
    """
    spec = get_model(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
    path = cache_path(spec.cache_name, micro_batch, optimizer, cache_dir, device)
    if not refresh and path.is_file():
        try:
            cached = ModelProfile.from_dict(json.loads(path.read_text()))
            if (cached.model, cached.micro_batch, cached.optimizer, cached.device) == (
                spec.name,
                micro_batch,
                optimizer,
                host_id(device),
            ):
                return cached
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            pass  # corrupt or outdated: profile again below
    _make_cache_dir(path.parent, cache_dir)  # before profiling: a bad directory is one line at once
    profile = profile_model(spec, micro_batch, optimizer=optimizer, progress=progress, device=device, **kw)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"{_cache_dir_text(path.parent, cache_dir)} is not a writable directory ({exc})") from None
    return profile


def _cache_dir_text(directory: Path, cache_dir: str | Path | None) -> str:
    """How the cache directory is named in an error: the variable that set it, if one did."""
    if cache_dir is None and os.environ.get("ASTEROID_CACHE_DIR"):
        return f"ASTEROID_CACHE_DIR={os.environ['ASTEROID_CACHE_DIR']}"
    return f"profile cache {directory}"


def _make_cache_dir(directory: Path, cache_dir: str | Path | None) -> None:
    """Make the cache directory; UserError (a user's mistake, e.g. $ASTEROID_CACHE_DIR a file) if it cannot be
    made or written in."""
    try:
        if directory.exists() and not directory.is_dir():
            raise UserError(f"{_cache_dir_text(directory, cache_dir)} is not a writable directory (it is a file)")
        directory.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(directory, os.W_OK | os.X_OK) else "no permission to write in it"
    except OSError as exc:
        problem = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) != str(directory):
            problem += f": {exc.filename}"
    if problem:
        raise UserError(f"{_cache_dir_text(directory, cache_dir)} is not a writable directory ({problem})")
