"""Devices and clusters: the built-in clusters, Jetson facts, and the cluster file (every mistake named)."""

import json
import random
from collections import Counter

import pytest

from engine.devices import CLUSTERS, GIB, KINDS, Cluster, Device, get_kind, load_cluster
from engine.errors import UserError


def kinds(cluster: Cluster) -> Counter:
    return Counter(d.kind for d in cluster.devices)


def test_builtin_clusters_match_the_evaluation():
    assert kinds(load_cluster("A")) == {"jetson-nano": 5}
    assert kinds(load_cluster("B")) == {"jetson-xavier-nx": 3, "jetson-tx2": 2}
    assert kinds(load_cluster("C")) == {"jetson-xavier-nx": 1, "jetson-tx2": 2, "jetson-nano": 3}
    assert kinds(load_cluster("D")) == {"jetson-tx2": 1, "jetson-nano": 3}
    assert set(CLUSTERS) == {"A", "B", "C", "D"}


def test_cluster_c_devices_and_names():
    c = load_cluster("C")
    assert [d.name for d in c.devices] == ["nx-0", "tx2-0", "tx2-1", "nano-0", "nano-1", "nano-2"]
    assert c.name == "C"
    assert load_cluster("c") == c  # the letter is case-insensitive
    assert c.device("tx2-1").kind == "jetson-tx2"
    with pytest.raises(UserError, match="orin-0"):
        c.device("orin-0")


def test_jetson_facts():
    # The Jetson figures (docs/planning.md): Nano 4 GB ~0.47 TFLOPS, TX2 8 GB ~1.33, Xavier NX 8 GB ~1.69 (FP16 peak).
    assert (KINDS["jetson-nano"].memory_gb, KINDS["jetson-nano"].gflops) == (4.0, 472.0)
    assert (KINDS["jetson-tx2"].memory_gb, KINDS["jetson-tx2"].gflops) == (8.0, 1330.0)
    assert (KINDS["jetson-xavier-nx"].memory_gb, KINDS["jetson-xavier-nx"].gflops) == (8.0, 1690.0)
    nano, nx = Device.of_kind("a", "nano"), Device.of_kind("b", "nx")
    assert nano.memory_bytes < nx.memory_bytes and nano.flops_per_s < nx.flops_per_s
    assert nano.memory_bytes == int((4.0 - KINDS["jetson-nano"].reserved_gb) * GIB)
    assert get_kind("Xavier-NX") is KINDS["jetson-xavier-nx"] is get_kind("jetson-xavier-nx")


def test_bandwidth_override():
    c = load_cluster("B", bandwidth_mbps=100)
    assert c.bandwidth_mbps == 100 and c.bytes_per_s == 12.5e6
    assert c.devices == load_cluster("B").devices
    assert load_cluster("B").bandwidth_mbps == 1000  # the built-in is untouched


def write(tmp_path, doc, name="cluster.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_cluster_file_with_custom_and_kind_devices(tmp_path):
    path = write(
        tmp_path,
        {
            "bandwidth_mbps": 100,
            "latency_ms": 1.5,
            "devices": [
                {"name": "nano-0", "kind": "jetson-nano"},
                {"name": "fast", "memory_gb": 6, "gflops": 900},
                {"name": "big-nano", "kind": "nano", "memory_gb": 8},
            ],
        },
    )
    c = load_cluster(path)
    assert c.name == "cluster" and c.bandwidth_mbps == 100 and c.latency_ms == 1.5
    nano, fast, big = c.devices
    assert nano == Device.of_kind("nano-0", "jetson-nano")
    assert (fast.kind, fast.memory_gb, fast.gflops, fast.reserved_gb) == ("custom", 6.0, 900.0, 0.0)
    assert fast.memory_bytes == 6 * GIB
    assert fast.flops_per_s == pytest.approx(900e9 * 0.25)
    # A kind with its memory overridden keeps the kind's speed and reserve but is no longer that kind.
    assert (big.kind, big.memory_gb, big.gflops, big.reserved_gb) == ("custom", 8.0, 472.0, 1.2)
    assert load_cluster(path, bandwidth_mbps=10).bandwidth_mbps == 10


def test_builtin_cluster_round_trips_through_its_document():
    for letter in "ABCD":
        c = load_cluster(letter, bandwidth_mbps=100)
        assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_custom_cluster_round_trips_without_reserve():
    c = Cluster.from_dict({"devices": [{"name": "x", "memory_gb": 6, "gflops": 900}, {"name": "n", "kind": "nano"}]})
    assert Cluster.from_dict(c.to_dict()) == c


def test_unknown_kind_names_the_kind(tmp_path):
    path = write(tmp_path, {"devices": [{"name": "a", "kind": "jetson-orin"}]})
    with pytest.raises(UserError, match="jetson-orin"):
        load_cluster(path)
    with pytest.raises(UserError, match="'orin'.*jetson-nano"):
        get_kind("orin")  # and lists the known kinds


def test_custom_device_without_memory_names_the_field(tmp_path):
    path = write(tmp_path, {"devices": [{"name": "a", "kind": "nano"}, {"name": "b", "gflops": 100}]})
    with pytest.raises(UserError, match=r"devices\[1\]\.memory_gb"):
        load_cluster(path)
    path = write(tmp_path, {"devices": [{"name": "b", "memory_gb": 4}]})
    with pytest.raises(UserError, match=r"devices\[0\]\.gflops"):
        load_cluster(path)


@pytest.mark.parametrize(
    "doc,needle",
    [
        ([{"name": "a", "kind": "nano"}], "JSON object"),
        ({"devices": []}, "'devices'"),
        ({"devices": "nano"}, "'devices'"),
        ({}, "'devices'"),
        ({"devices": ["nano"]}, r"devices\[0\]"),
        ({"devices": [{"kind": "nano"}]}, r"devices\[0\]\.name"),
        ({"devices": [{"name": "a", "kind": 3}]}, r"devices\[0\]\.kind"),
        ({"devices": [{"name": "a", "memory_gb": "8", "gflops": 1}]}, r"devices\[0\]\.memory_gb"),
        ({"devices": [{"name": "a", "memory_gb": 8, "gflops": True}]}, r"devices\[0\]\.gflops"),
        ({"devices": [{"name": "a", "memory_gb": -1, "gflops": 1}]}, r"devices\[0\]\.memory_gb"),
        ({"devices": [{"name": "a", "memory_gb": 4, "gflops": 0}]}, r"devices\[0\]\.gflops \(device 'a'\)"),
        ({"devices": [{"name": "a", "memory_gb": 1, "gflops": 5, "reserved_gb": 2}]}, "must exceed reserved"),
        ({"devices": [{"name": "a", "kind": "nano"}, {"name": "a", "kind": "tx2"}]}, "duplicate device names.*: a"),
        ({"devices": [{"name": "a", "kind": "nano"}], "bandwidth_mbps": "fast"}, "bandwidth_mbps"),
        ({"devices": [{"name": "a", "kind": "nano"}], "bandwidth_mbps": 0}, "bandwidth_mbps"),
        ({"devices": [{"name": "a", "kind": "nano"}], "latency_ms": -1}, "latency_ms"),
    ],
)
def test_malformed_cluster_documents(tmp_path, doc, needle):
    with pytest.raises(UserError, match=needle):
        load_cluster(write(tmp_path, doc))


def test_bad_json_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="not valid JSON"):
        load_cluster(write(tmp_path, '{"devices": [', name="broken.json"))
    with pytest.raises(UserError, match="cluster file .*nope.json does not exist"):
        load_cluster(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="unknown cluster 'E'"):
        load_cluster("E")
    with pytest.raises(UserError, match="cannot read"):
        binary = tmp_path / "binary.json"
        binary.write_bytes(b"\xff\xfe\x00")  # not UTF-8
        load_cluster(str(binary))


# A path given to --cluster that is missing or a directory was called "unknown cluster ... use one of A, B, C, D".
def test_a_cluster_path_that_is_missing_or_a_directory_is_called_so(tmp_path):
    with pytest.raises(UserError, match=f"cluster file {tmp_path} is a directory"):
        load_cluster(str(tmp_path))
    with pytest.raises(UserError, match="cluster file lab/c does not exist"):
        load_cluster("lab/c")
    with pytest.raises(UserError, match="cluster file lab.json does not exist"):
        load_cluster("lab.json")
    with pytest.raises(UserError, match="unknown cluster 'lab': use one of A, B, C, D"):
        load_cluster("lab")


# Numbers past what any board has reached the planner: memory_gb 1e308 overflowed memory_bytes, 1e30 overflowed
# an int64 array, gflops 1e308 (or 1e-300) divided by zero, and inf bandwidth (1e400 in JSON) was accepted.
@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"devices": [{"name": "a", "memory_gb": 1e308, "gflops": 900}]}', r"devices\[0\]\.memory_gb \(device 'a'\) "
         r"must be a number from 0 to 1024, got 1e\+308"),
        ('{"devices": [{"name": "a", "memory_gb": 1e30, "gflops": 900}]}', r"memory_gb \(device 'a'\)"),
        ('{"devices": [{"name": "a", "memory_gb": 8, "gflops": 1e308}]}', r"gflops \(device 'a'\) .* to 1e\+06"),
        ('{"devices": [{"name": "a", "memory_gb": 8, "gflops": 1e-300}]}', r"gflops \(device 'a'\) .* from 1e-06"),
        ('{"devices": [{"name": "a", "memory_gb": 8, "gflops": 9' + "0" * 400 + '}]}', r"gflops \(device 'a'\)"),
        ('{"devices": [{"name": "a", "memory_gb": 8, "gflops": NaN}]}', r"gflops \(device 'a'\) .* got nan"),
        ('{"devices": [{"name": "a", "kind": "nano", "reserved_gb": 1e9}]}', r"reserved_gb \(device 'a'\)"),
        ('{"devices": [{"name": "a", "kind": "nano", "bandwidth_mbps": 1e400}]}',
         r"devices\[0\]\.bandwidth_mbps \(device 'a'\) must be a number from 0.001 to 1e\+06, got inf"),
        ('{"devices": [{"name": "a", "kind": "nano"}], "bandwidth_mbps": 1e400}', "cluster file: bandwidth_mbps .*inf"),
        ('{"devices": [{"name": "a", "kind": "nano"}], "bandwidth_mbps": Infinity}', "cluster file: bandwidth_mbps"),
        ('{"devices": [{"name": "a", "kind": "nano"}], "latency_ms": 1e9}', "cluster file: latency_ms .* to 10000"),
    ],
)  # fmt: skip
def test_out_of_range_numbers_in_a_cluster_file_are_refused(tmp_path, text, needle):
    with pytest.raises(UserError, match=needle):
        load_cluster(write(tmp_path, text))


@pytest.mark.parametrize("end", [1, 0], ids=["most", "least"])
def test_the_numbers_at_a_cluster_files_bounds_plan(end):
    from engine.devices import LIMITS
    from engine.planners import Problem, make_plan
    from tests.engine.instances import layered_workload

    at = {key: bounds[end] for key, bounds in LIMITS.items()}
    big = {"name": "a", "memory_gb": 1024, "gflops": at["gflops"], "bandwidth_mbps": at["bandwidth_mbps"]}
    doc = {"devices": [big, {"name": "b", "kind": "nano"}], "bandwidth_mbps": at["bandwidth_mbps"]}
    cluster = Cluster.from_dict({**doc, "latency_ms": at["latency_ms"]})
    assert cluster.device("a").memory_bytes == 1024 * GIB
    plan = make_plan("asteroid", Problem(layered_workload(random.Random(0), 4), cluster, 64))
    assert plan.predicted.fits and 0 < plan.predicted.throughput < float("inf")


def test_cluster_construction_checks():
    with pytest.raises(UserError, match="at least one device"):
        Cluster(())
    with pytest.raises(UserError, match="non-empty name"):
        Device("", "custom", 4, 100)


def test_a_cluster_file_device_may_carry_its_probe(tmp_path):
    from engine.predictor.probe import PROBE_KEYS

    probe = {k: [1e-4, 2e-4] for k in PROBE_KEYS}
    doc = {"devices": [{"name": "orin", "memory_gb": 8, "gflops": 900, "probe": probe}, {"name": "n", "kind": "nano"}]}
    cluster = Cluster.from_dict(doc)
    orin = cluster.device("orin")
    assert orin.kind == "custom" and json.loads(orin.probe) == probe
    assert Cluster.from_dict(cluster.to_dict()).device("orin") == orin  # round trip
    assert orin.spec != Device("x", "custom", 8, 900).spec  # a probed device is planned apart
    bad = {"devices": [{"name": "orin", "memory_gb": 8, "gflops": 900, "probe": {"mobilenetv2:0": [1, -1]}}]}
    with pytest.raises(UserError, match=r"devices\[0\]\.probe: probe lacks layers"):
        Cluster.from_dict(bad)
