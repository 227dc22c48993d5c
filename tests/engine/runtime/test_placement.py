"""Where a device computes: on the CPU the seam is the identity and the run's clock times its steps, so the path CI
runs is the GPU's with another device; a GPU asked for where there is none is one line before anything starts."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from engine.errors import UserError
from engine.runtime import layerstate
from engine.runtime.emulation import now
from engine.runtime.launcher import train
from engine.runtime.options import RunOptions
from engine.runtime.placement import Accelerator, Placement
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU: cuda is no mistake here")


def test_on_the_cpu_every_copy_is_the_identity_and_steps_are_timed_by_the_runs_clock():
    place = Placement.resolve("cpu")
    x = torch.randn(4, 3)
    assert place.load(x) is x and place.host([x])[0] is x and place.allocated() is None
    before = now()
    timer = place.timer()
    torch.randn(64, 64) @ torch.randn(64, 64)
    assert before <= timer.started() <= now()
    layer = torch.nn.Linear(3, 2)
    weight = layer.weight
    place.put([layer])
    assert layer.weight is weight  # the optimizer's parameters are the layer's, wherever they are
    states = layerstate.capture([layer], 0, 1, None)  # copies on the host, not views of the weights
    assert states[0]["p.weight"].device.type == "cpu" and states[0]["p.weight"].data_ptr() != weight.data_ptr()
    assert Accelerator.of_host().to_dict()["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


@NO_GPU
def test_cuda_where_torch_sees_no_gpu_is_one_line_and_auto_computes_on_the_cpu():
    with pytest.raises(UserError, match="--device cuda: this host's torch sees no CUDA GPU"):
        Placement.resolve("cuda")
    assert Placement.resolve("auto").device == torch.device("cpu")
    with pytest.raises(UserError, match="device must be one of auto, cpu, cuda; got 'tpu'"):
        RunOptions(device="tpu")
    command = [sys.executable, "-m", "engine", "train", "--model", "gpt-small", "--cluster", "C", "--device", "cuda"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "sees no CUDA GPU" in done.stderr, done.stderr


def test_each_device_says_where_it_computes():
    cluster = cluster_of("nx", "tx2")
    plan = make_plan("gpt-small", cluster, 4, 2, [(0, 7, [("nx-0", 2)]), (7, 15, [("tx2-1", 2)])])
    opts = RunOptions(iterations=1, emulate=False, timeout_s=60)
    events = []
    train(plan, model_workload("gpt-small"), replace(opts, device="cpu"), events.append)
    where = {e["device"]: e["compute"] for e in events if e["type"] == "device-start"}
    assert where == {"nx-0": "cpu", "tx2-1": "cpu"}, where
