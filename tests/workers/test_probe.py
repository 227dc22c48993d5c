"""The device probe: a real matmul speed, memory from the host, an emulated kind's figures, the LAN address."""

import pytest

from engine.devices import KINDS
from workers.probe import local_address, matmul_gflops, measure, memory_bytes


def test_the_host_is_measured():
    gflops = matmul_gflops(n=256, seconds=0.05)
    assert gflops > 0.1  # any CPU of this decade does far more; zero or negative would be a broken timer
    assert memory_bytes() > 2**28


@pytest.mark.parametrize("alias, key", [("nano", "jetson-nano"), ("tx2", "jetson-tx2"), ("nx", "jetson-xavier-nx")])
def test_emulated_figures_are_the_kinds_and_the_host_speed_is_still_measured(alias, key):
    c = measure(alias)
    kind = KINDS[key]
    assert (c.kind, c.emulated, c.gflops) == (key, True, kind.gflops)
    assert c.memory_bytes == int(kind.memory_gb * 2**30)
    assert c.host_gflops > 0


def test_unemulated_figures_are_measured():
    c = measure()
    assert not c.emulated and c.gflops == c.host_gflops > 0 and c.memory_bytes == memory_bytes()


def test_a_child_process_measures_what_the_agent_would_and_says_where_it_computes():
    # what `measure` does on a host with a GPU (so the agent holds no CUDA context): the figures come back whole
    import multiprocessing

    import torch

    from workers.probe import _measure

    with multiprocessing.get_context("spawn").Pool(1) as child:
        c = child.apply(_measure, ("nano",))
    assert (c.kind, c.emulated, c.compute) == ("jetson-nano", True, "cuda" if torch.cuda.is_available() else "cpu")
    assert c.to_dict()["gpu_memory"] == c.gpu_memory and c.host_gflops > 0


def test_address_towards_a_loopback_server_is_loopback():
    assert local_address("127.0.0.1", 8000) == "127.0.0.1"
    assert local_address("localhost", 8000) == "127.0.0.1"
