"""Why a plan leaves a device out (engine/planners/explain.py): each unused device tried in each stage, in words."""

from engine.devices import Cluster, Device
from engine.planners.explain import left_out, with_device
from engine.workloads import workload
from tests.engine.runtime.helpers import make_plan


def cluster(*devices: Device, mbps: float = 1000.0) -> Cluster:
    return Cluster(devices, mbps, name="test")


def test_a_slow_board_on_a_slow_link_is_said_to_cost_more_than_it_brings():
    c = cluster(Device.of_kind("nx-0", "nx"), Device.of_kind("nx-1", "nx"),
                Device("slow-0", "custom", 8.0, 5.0, link_mbps=5.0))  # fmt: skip
    w = workload("mobilenetv2", cluster=c)
    plan = make_plan("mobilenetv2", c, 32, 2, [(0, w.num_layers, [("nx-0", 8), ("nx-1", 8)])])
    why = left_out(plan, w)
    assert list(why) == ["slow-0"]
    assert why["slow-0"].startswith("with it in stage 0 (beside nx-0, nx-1), its best place, the plan would predict ")
    assert "slower than the stage's fastest device" in why["slow-0"] and "all-reduce would take" in why["slow-0"]
    trial = with_device(plan, w, 0, "slow-0")
    assert [s.name for s in trial.stages[0].devices] == ["nx-0", "nx-1", "slow-0"]
    assert sum(s.samples for s in trial.stages[0].devices) == 16  # the micro-batch split again, not grown


def test_a_board_too_small_for_any_stage_is_said_so_and_a_plan_using_every_board_explains_nothing():
    c = cluster(Device.of_kind("nx-0", "nx"), Device("tiny-0", "custom", 0.01, 100.0))
    w = workload("mobilenetv2", cluster=c)
    plan = make_plan("mobilenetv2", c, 32, 1, [(0, w.num_layers, [("nx-0", 32)])])
    assert left_out(plan, w) == {"tiny-0": "no stage of this plan fits in its 0.0 GiB beside the stage's devices"}
    everyone = make_plan("mobilenetv2", c, 32, 1, [(0, 3, [("tiny-0", 32)]), (3, w.num_layers, [("nx-0", 32)])])
    assert left_out(everyone, w) == {}


def test_the_cli_plan_says_why_a_device_is_left_out(capsys, tmp_path):
    import json

    from tests.engine.clirun import run

    path = tmp_path / "lab.json"
    slow = {"name": "slow-0", "gflops": 5, "memory_gb": 8, "bandwidth_mbps": 5}
    path.write_text(json.dumps({"devices": [{"name": "nx-0", "kind": "nx"}, {"name": "nx-1", "kind": "nx"}, slow]}))
    code, out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", str(path), "--batch-size", "32",
                         "--method", "asteroid")  # fmt: skip
    assert code == 0, err
    assert "left out: slow-0: with it in stage" in out
