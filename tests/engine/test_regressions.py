"""Regressions in engine/: one test per bug found, named after it, with a comment saying what went wrong."""

import pytest
from torch import nn

from engine.devices import Cluster
from engine.models import ModelSpec
from engine.profiler import profile_model


# Device.to_dict dropped reserved_gb: a custom device read back had another memory_bytes (fixed in fe15486).
@pytest.mark.parametrize(
    "device",
    [
        {"name": "x", "memory_gb": 6, "gflops": 900, "reserved_gb": 1.0},
        {"name": "x", "kind": "nano", "memory_gb": 6},  # custom, keeps the Nano's 1.2 GB reserve
        {"name": "x", "kind": "nano", "reserved_gb": 0.5},  # still "jetson-nano", reserve 0.5
    ],
)
def test_reserved_memory_survives_the_cluster_document(device):
    c = Cluster.from_dict({"devices": [device]})
    back = Cluster.from_dict(c.to_dict())
    assert back.devices[0].memory_bytes == c.devices[0].memory_bytes
    assert back == c


# torch's convolution_backward FLOP formula ignores groups: depthwise convs were counted x groups.
def test_depthwise_conv_flops_are_not_counted_once_per_group():
    spec = ModelSpec(
        "dw",
        "cnn",
        "classification",
        (8, 6, 6),
        "float32",
        2,
        "depthwise conv",
        lambda: [nn.Identity(), nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)],
    )
    forward = 2 * 8 * 1 * 9 * 36  # per sample: 2 * out channels * in channels per group * kernel * positions
    assert profile_model(spec, micro_batch=2, repeats=1, warmup=0).layers[1].flops == 3 * forward
