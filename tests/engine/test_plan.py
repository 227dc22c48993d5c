"""Plan JSON: round trip, validation and parse errors that name the field."""

import copy
import json

import pytest

from engine.devices import load_cluster
from engine.errors import UserError
from engine.plan import Plan, Prediction, Share, Stage


def sample_plan() -> Plan:
    cluster = load_cluster("C", bandwidth_mbps=100)
    stages = (
        Stage(0, 7, (Share("nx-0", 10), Share("tx2-0", 6))),
        Stage(7, 12, (Share("tx2-1", 9), Share("nano-0", 4), Share("nano-1", 3))),
        Stage(12, 20, (Share("nano-2", 16),)),
    )
    return Plan("asteroid", "mobilenetv2", 128, 8, stages, cluster)


def sample_doc() -> dict:
    return sample_plan().to_dict()


def test_document_shape_matches_the_contract():
    pred = Prediction(1.23, 104.1, 0.12, {"nx-0": 123456789}, True)
    doc = json.loads(json.dumps(sample_plan().with_prediction(pred).to_dict()))
    assert doc["method"] == "asteroid" and doc["model"] == "mobilenetv2"
    assert (doc["batch_size"], doc["micro_batches"], doc["bandwidth_mbps"]) == (128, 8, 100)
    assert doc["stages"][0] == {
        "layers": [0, 7],
        "devices": [{"name": "nx-0", "samples": 10}, {"name": "tx2-0", "samples": 6}],
    }
    assert doc["predicted"] == {
        "iteration_s": 1.23,
        "throughput": 104.1,
        "bubble_fraction": 0.12,
        "memory_bytes": {"nx-0": 123456789},
        "fits": True,
    }
    assert [d["name"] for d in doc["cluster"]["devices"]] == [d.name for d in load_cluster("C").devices]


def test_a_simulated_prediction_survives_json_and_is_what_to_expect():
    pred = Prediction(1.2, 100.0, 0.1, {"nx-0": 1}, True, simulated_s=1.0)
    doc = json.loads(json.dumps(sample_plan().with_prediction(pred).to_dict()))
    assert doc["predicted"]["simulated_s"] == 1.0
    back = Plan.from_dict(doc, keep_prediction=True).predicted
    assert back == pred and back.expected_s == 1.0 and back.expected_throughput == 120.0
    closed_only = Prediction(1.2, 100.0, 0.1, {"nx-0": 1}, True)
    assert closed_only.expected_s == 1.2 and closed_only.expected_throughput == 100.0
    doc["predicted"]["simulated_s"] = "fast"
    with pytest.raises(UserError, match="predicted.simulated_s must be a number"):
        Plan.from_dict(doc, keep_prediction=True)


def test_round_trip():
    plan = sample_plan()
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    assert back.stages == plan.stages and back.cluster.devices == plan.cluster.devices
    assert back.cluster.bandwidth_mbps == 100
    back.validate(20)
    assert back.micro_batch_size == 16
    assert back.device_names == ["nx-0", "tx2-0", "tx2-1", "nano-0", "nano-1", "nano-2"]


def test_predicted_block_is_ignored_and_bandwidth_overrides_the_cluster():
    doc = sample_doc()
    doc["predicted"] = {"iteration_s": "garbage"}
    doc["bandwidth_mbps"] = 250
    plan = Plan.from_dict(doc)
    assert plan.predicted is None
    assert plan.cluster.bandwidth_mbps == 250


def test_stored_prediction_is_kept_when_asked_and_checked():
    pred = Prediction(1.23, 104.1, 0.12, {"nx-0": 123456789}, False)
    doc = json.loads(json.dumps(sample_plan().with_prediction(pred).to_dict()))
    assert Plan.from_dict(doc, keep_prediction=True).predicted == pred
    assert Plan.from_dict(sample_doc(), keep_prediction=True).predicted is None
    doc["predicted"]["fits"] = "yes"
    with pytest.raises(UserError, match="predicted.fits"):
        Plan.from_dict(doc, keep_prediction=True)
    doc["predicted"] = {"iteration_s": "garbage"}
    with pytest.raises(UserError, match="predicted.iteration_s"):
        Plan.from_dict(doc, keep_prediction=True)


def mutated(**changes) -> dict:
    doc = copy.deepcopy(sample_doc())
    for key, value in changes.items():
        if value is None:
            del doc[key]
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize(
    "doc,needle",
    [
        ([], "top level"),
        ("plan", "top level"),
        (mutated(stages=None), "missing field 'stages'"),
        (mutated(cluster=None), "missing field 'cluster'"),
        (mutated(method=None), "missing field 'method'"),
        (mutated(model=None), "missing field 'model'"),
        (mutated(batch_size=None), "missing field 'batch_size'"),
        (mutated(micro_batches=None), "missing field 'micro_batches'"),
        (mutated(stages={"layers": [0, 20]}), "'stages' has the wrong type"),
        (mutated(batch_size="128"), "'batch_size' has the wrong type"),
        (mutated(batch_size=True), "'batch_size' has the wrong type"),
        (mutated(micro_batches=2.0), "'micro_batches' has the wrong type"),
        (mutated(bandwidth_mbps="fast"), "'bandwidth_mbps' has the wrong type"),
        (mutated(bandwidth_mbps=float("inf")), "plan: bandwidth_mbps must be a number from 0.001 to 1e\\+06, got inf"),
        (mutated(micro_batches=0), "positive"),
        (mutated(allreduce="int8"), "'allreduce' must be one of off, fp16, bf16"),
        (mutated(allreduce=["fp16"]), "'allreduce' must be one of"),
        (mutated(cluster={"devices": [{"name": "a", "kind": "orin"}]}), "orin"),
        (mutated(stages=[[0, 20]]), r"stages\[0\] must be an object"),
        (mutated(stages=[{"layers": [0], "devices": []}]), r"stages\[0\]\.layers"),
        (mutated(stages=[{"layers": [0, 2.5], "devices": []}]), r"stages\[0\]\.layers"),
        (mutated(stages=[{"layers": [0, 20]}]), r"stages\[0\]\.devices must be a list"),
        (
            mutated(stages=[{"layers": [0, 20], "devices": [{"name": "nx-0", "samples": 8}, {"name": "tx2-0"}]}]),
            r"stages\[0\]\.devices\[1\]",
        ),
        (
            mutated(stages=[{"layers": [0, 20], "devices": [{"name": "nx-0", "samples": "8"}]}]),
            r"stages\[0\]\.devices\[0\]",
        ),
    ],
)
def test_parse_errors_name_the_field(doc, needle):
    with pytest.raises(UserError, match=needle):
        Plan.from_dict(doc)


def with_stages(*stages, batch_size=128, micro_batches=8) -> Plan:
    return Plan("hand", "m", batch_size, micro_batches, tuple(stages), load_cluster("C"))


@pytest.mark.parametrize(
    "plan,needle",
    [
        (with_stages(Stage(0, 20, (Share("nx-0", 10), Share("tx2-0", 5)))), r"stages\[0\] shares sum to 15.*16"),
        (
            with_stages(Stage(0, 9, (Share("nx-0", 16),)), Stage(9, 20, (Share("tx2-0", 17),))),
            r"stages\[1\] shares sum to 17",
        ),
        (with_stages(Stage(0, 9, (Share("nx-0", 16),)), Stage(10, 20, (Share("tx2-0", 16),))), r"stages\[1\]\.layers"),
        (with_stages(Stage(1, 20, (Share("nx-0", 16),))), r"stages\[0\]\.layers"),
        (with_stages(Stage(0, 9, (Share("nx-0", 16),)), Stage(9, 9, (Share("tx2-0", 16),))), "non-empty"),
        (with_stages(Stage(0, 12, (Share("nx-0", 16),))), r"cover layers \[0, 12\).*20"),
        (with_stages(Stage(0, 20, ())), r"stages\[0\] has no devices"),
        (with_stages(Stage(0, 20, (Share("nx-0", 17), Share("tx2-0", -1)))), "at least 1 sample"),
        (with_stages(Stage(0, 20, (Share("orin-0", 16),))), "orin-0"),
        (
            with_stages(Stage(0, 9, (Share("nx-0", 16),)), Stage(9, 20, (Share("nx-0", 8), Share("tx2-0", 8)))),
            "nx-0 appear in more than one place",
        ),
        (with_stages(Stage(0, 20, (Share("nx-0", 16),)), batch_size=100), "not divisible"),
        (with_stages(batch_size=128), "at least one stage"),
    ],
)
def test_validate_names_the_problem(plan, needle):
    with pytest.raises(UserError, match=needle):
        plan.validate(20)


def test_shares_not_summing_parse_but_fail_validation():
    doc = sample_doc()
    doc["stages"][1]["devices"][0]["samples"] = 8  # 8 + 4 + 3 = 15, not 16
    plan = Plan.from_dict(doc)  # parsing is structural ...
    with pytest.raises(UserError, match=r"stages\[1\] shares sum to 15, but a micro-batch has 16 samples"):
        plan.validate(20)  # ... the sum is checked by validate (and so by every scorer)
