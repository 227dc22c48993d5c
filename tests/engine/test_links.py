"""Per-link bandwidth: a board's own link (a cluster file's per-device bandwidth_mbps) in the cost model, the
simulator's steps and the planner; a transfer runs at its slower end, an all-reduce at its ring's slowest link."""

import json
from dataclasses import replace

import pytest

from engine.costmodel import Workload, allreduce_s, link_s, score
from engine.devices import Cluster, Device, load_cluster
from engine.errors import UserError
from engine.plan import Plan
from engine.planners import PLANNERS, Problem
from engine.simulator import simulate
from engine.steps import device_steps
from tests.engine.runtime.helpers import make_plan


def workload(layers: int = 8, out: int = 400_000, params: int = 2_000_000) -> Workload:
    """Layers of equal compute whose activations (`out` bytes a sample) make the links matter."""
    return Workload("links", (2e8,) * layers, (4e8,) * layers, (out,) * layers, (1e6,) * layers, (3e5,) * layers,
                    (params,) * layers, (params,) * layers)  # fmt: skip


def cluster(slow: dict[str, float] | None = None) -> Cluster:
    devices = [Device.of_kind(n, "nx") for n in ("a", "b", "c", "d")]
    devices = [replace(d, link_mbps=(slow or {}).get(d.name)) for d in devices]
    return Cluster(tuple(devices), bandwidth_mbps=1000.0, name="links")


def two_stage_plan(c: Cluster, first: tuple[str, ...], second: tuple[str, ...], layers: int = 8) -> Plan:
    m = 8
    shares = lambda names: [(n, m // len(names)) for n in names]  # noqa: E731
    return make_plan("links", c, 4 * m, 4, [(0, layers // 2, shares(first)), (layers // 2, layers, shares(second))])


def test_a_transfer_runs_at_its_slower_end_and_a_device_alone_at_its_own_link():
    c = cluster({"b": 20.0})
    assert c.bytes_per_s_of() == c.bytes_per_s == 125e6
    assert c.bytes_per_s_of("a") == 125e6 and c.bytes_per_s_of("b") == 2.5e6
    assert c.bytes_per_s_of("a", "b") == c.bytes_per_s_of("b", "a") == 2.5e6
    assert link_s(c, 2.5e6, "a", "b") == pytest.approx(c.latency_s + 1.0)
    assert link_s(c, 2.5e6, "a", "c") == pytest.approx(c.latency_s + 0.02)
    w = workload()
    assert allreduce_s(w, c, 0, 4, 2, names=("a", "b")) == pytest.approx(
        50 * allreduce_s(w, c, 0, 4, 2, names=("a", "c")), rel=0.01
    )


def test_a_cluster_file_gives_a_board_its_own_link(tmp_path):
    doc = {"bandwidth_mbps": 100, "devices": [{"name": "n0", "kind": "nano", "bandwidth_mbps": 20},
                                              {"name": "x0", "kind": "nx"}]}  # fmt: skip
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(doc))
    c = load_cluster(str(path))
    assert c.device("n0").link_mbps == 20.0 and c.device("n0").kind == "jetson-nano"
    assert c.device("x0").link_mbps is None and c.link_mbps_of(c.device("x0")) == 100.0
    assert Cluster.from_dict(c.to_dict()) == c  # the plan file carries it
    assert c.with_bandwidth(1000).device("n0").link_mbps == 20.0  # --bandwidth-mbps is the others' default
    for bad in (0, -5, "fast", True, 1e400):  # 1e400: JSON's Infinity
        doc["devices"][0]["bandwidth_mbps"] = bad
        path.write_text(json.dumps(doc))
        with pytest.raises(UserError, match=r"devices\[0\]\.bandwidth_mbps \(device 'n0'\) must be a number from"):
            load_cluster(str(path))


def test_a_board_on_a_slow_link_makes_the_plan_it_is_in_slower_everywhere():
    w, fast, slow = workload(), cluster(), cluster({"b": 10.0})
    plan = two_stage_plan(fast, ("a",), ("b",))
    on_slow = replace(plan, cluster=slow)
    assert score(on_slow, w).iteration_s > 2 * score(plan, w).iteration_s
    assert simulate(on_slow, w).iteration_s > 2 * simulate(plan, w).iteration_s
    # the activations a sends b cross b's 10 Mbps link: the step's transfer time says so
    steps = device_steps(on_slow, w)
    (send,) = steps["a"].send_forward
    assert send.seconds == pytest.approx(link_s(slow, 8 * 400_000, "a", "b"))
    # a data-parallel stage's all-reduce runs at its slowest member's link
    dp = replace(two_stage_plan(slow, ("a", "b"), ("c",)), cluster=slow)
    assert device_steps(dp, w)["a"].allreduce_s == pytest.approx(
        allreduce_s(w, slow, 0, 4, 2, names=("a", "b")))  # fmt: skip


@pytest.mark.parametrize("method", ["asteroid", "exhaustive"])
def test_the_planner_keeps_a_board_on_slow_wifi_off_the_critical_links(method):
    w = workload(layers=6, out=2_000_000)
    slow = cluster({"b": 2.0})
    plan = PLANNERS[method](Problem(w, slow, 32))
    assert "b" not in plan.device_names, plan.to_dict()["stages"]  # 2 Mbps: no transfer through it pays
    assert score(plan, w).throughput == pytest.approx(plan.predicted.throughput, rel=1e-6)
    # the same four boards on their wired links: b is worth using
    assert "b" in PLANNERS[method](Problem(w, cluster(), 32)).device_names


def test_auto_compression_picks_each_boundary_by_its_own_link():
    """Three stages a > b > c, a and b on 10 Gbps links, c on 20 Mbps, with a codec slow enough to cost more
    than it saves on a fast link: `auto` compresses b-c (through c's link) to 2 bits and leaves a-b uncompressed;
    with c on a fast link too, it compresses nothing."""
    from engine.planners.levels import refine

    def chosen(c_mbps: float) -> tuple[int, ...]:
        c = cluster({"a": 10_000.0, "b": 10_000.0, "c": c_mbps})
        w = replace(workload(layers=9), codec_work=((8, 2000.0), (4, 2000.0), (2, 2000.0)))
        plan = make_plan("links", c, 32, 8, [(0, 3, [("a", 4)]), (3, 6, [("b", 4)]), (6, 9, [("c", 4)])])
        return refine(plan.with_prediction(score(plan, w)), Problem(w, c, 32), (32, 8, 4, 2)).compression

    assert chosen(20.0) == (32, 2)
    assert chosen(10_000.0) == ()
