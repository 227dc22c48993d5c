"""`python -m engine plan | simulate | models`: JSON schema, human tables, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.cli import main


@pytest.fixture(autouse=True)
def _profiles(profile_cache):
    """Every command here uses the quick mobilenetv2 profile of conftest's `profile_cache`."""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *extra: str) -> dict:
    code, out, err = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "64", "--json", *extra
    )
    assert code == 0, err
    return json.loads(out)


def test_plan_json_schema(capsys):
    doc = plan_json(capsys)
    assert doc["method"] == "asteroid" and doc["model"] == "mobilenetv2" and doc["batch_size"] == 64
    assert doc["bandwidth_mbps"] == 1000
    assert 64 % doc["micro_batches"] == 0
    micro = 64 // doc["micro_batches"]
    covered = 0
    for st in doc["stages"]:
        assert st["layers"][0] == covered and st["layers"][1] > covered
        covered = st["layers"][1]
        assert sum(d["samples"] for d in st["devices"]) == micro
        assert all(set(d) == {"name", "samples"} for d in st["devices"])
    pred = doc["predicted"]
    assert pred["iteration_s"] > 0 and pred["fits"] is True
    assert pred["throughput"] == pytest.approx(64 / pred["iteration_s"])
    assert 0 <= pred["bubble_fraction"] < 1
    assert set(pred["memory_bytes"]) == {d["name"] for st in doc["stages"] for d in st["devices"]}
    assert {d["name"] for d in doc["cluster"]["devices"]} == {"nx-0", "tx2-0", "tx2-1", "nano-0", "nano-1", "nano-2"}


def test_plan_all_asteroid_is_best(capsys):
    code, out, err = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "128", "--method", "all", "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    plans = doc["plans"]
    assert set(plans) == {"asteroid", "dp", "gpipe", "pipedream", "ftpipehd"}
    ours = plans["asteroid"]["predicted"]["throughput"]
    for method, p in plans.items():
        if "predicted" in p and p["predicted"]["fits"]:
            assert ours >= p["predicted"]["throughput"] * (1 - 1e-9), method
    assert doc["ideal_throughput"] > ours


def test_plan_all_human_table(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "128", "--method", "all"
    )
    assert code == 0
    for word in ("method", "asteroid", "pipedream", "ftpipehd", "ideal", "stage", "samples", "memory GiB"):
        assert word in out
    assert "predicted:" in out


def test_bandwidth_override_changes_the_plan_document(capsys):
    doc = plan_json(capsys, "--bandwidth-mbps", "100")
    assert doc["bandwidth_mbps"] == 100
    fast = plan_json(capsys)
    assert doc["predicted"]["iteration_s"] >= fast["predicted"]["iteration_s"]


def test_simulate_json_and_trace(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan_json(capsys)))
    trace = tmp_path / "trace.json"
    code, out, err = run(capsys, "simulate", "--plan", str(plan_file), "--trace", str(trace), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {"iteration_s", "throughput", "bubble_fraction", "memory_bytes", "fits"} <= set(doc)
    assert doc["fits"] is True and doc["iteration_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    kinds = {e["cat"] for e in events if e["ph"] == "X"}
    assert {"F", "B"} <= kinds


def test_simulate_scores_a_hand_edited_plan_that_does_not_fit(capsys, tmp_path):
    doc = plan_json(capsys)
    # Everything on one Nano: a legal plan that breaks its memory at a big micro-batch.
    doc["micro_batches"] = 1
    doc["batch_size"] = 4096
    doc["stages"] = [{"layers": [0, doc["stages"][-1]["layers"][1]], "devices": [{"name": "nano-0", "samples": 4096}]}]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    code, out, err = run(capsys, "simulate", "--plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["fits"] is False


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "--model", "alexnet", "--cluster", "C", "--batch-size", "8"], "unknown model 'alexnet'"),
        (["plan", "--model", "mobilenetv2", "--cluster", "Z", "--batch-size", "8"], "unknown cluster 'Z'"),
        (
            ["plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "8", "--method", "nope"],
            "invalid choice",
        ),
        (["simulate", "--plan", "/nonexistent/plan.json"], "does not exist"),
    ],
)
def test_errors_are_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) if "--method" in argv else _no_raise():
        code = main(argv)
        assert code == 2
    _out, err = capsys.readouterr()
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_batch_size(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and len(err.strip().splitlines()) == 1


def test_malformed_cluster_file_names_the_field(capsys, tmp_path):
    path = tmp_path / "lab.json"
    path.write_text(json.dumps({"devices": [{"name": "x", "gflops": 900}]}))
    code, _out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", str(path), "--batch-size", "8")
    assert code == 2
    assert "devices[0].memory_gb" in err and len(err.strip().splitlines()) == 1


def test_model_that_does_not_fit_offers_a_smaller_batch(capsys, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"devices": [{"name": "tiny", "memory_gb": 0.08, "gflops": 100}]}))
    code, _out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", str(path), "--batch-size", "4096")
    assert code == 2
    assert "does not fit" in err and "try --batch-size" in err
    assert len(err.strip().splitlines()) == 1
    suggested = int(err.rsplit("--batch-size", 1)[1].split()[0])
    code, out, err = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", str(path), "--batch-size", str(suggested)
    )
    assert code == 0, err


# `--bandwidth-mbps inf` (and 1e400, read as inf) planned on an infinitely fast network.
@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "0", "2e6"])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_bandwidth_override_must_be_in_a_cluster_files_bounds(capsys, command, value):
    from engine.cli.parser import build_parser

    argv = [command, "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "8", "--bandwidth-mbps", value]
    with pytest.raises(SystemExit) as exc:  # the parser alone: without the bound, train would train
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--bandwidth-mbps: must be from 0.001 to 1e+06, got {value}" in err and len(err.strip().splitlines()) == 1


# A cluster file's out-of-range numbers were tracebacks from deep in the planner (OverflowError, ZeroDivisionError).
@pytest.mark.parametrize("field, value", [("memory_gb", 1e308), ("memory_gb", 1e30), ("gflops", 1e308)])
def test_out_of_range_cluster_numbers_are_one_line(capsys, tmp_path, field, value):
    path = tmp_path / "lab.json"
    devices = [{"name": "x", "kind": "nano", field: value}, {"name": "y", "kind": "tx2"}]
    path.write_text(json.dumps({"devices": devices}))
    code, _out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", str(path), "--batch-size", "64")
    assert code == 2, err
    assert f"devices[0].{field} (device 'x') must be a number from" in err and len(err.strip().splitlines()) == 1


# `--cluster /missing.json` (or a directory) said "unknown cluster ... use one of A, B, C, D or a cluster JSON file".
def test_a_cluster_path_that_is_missing_or_a_directory_says_so(capsys, tmp_path):
    missing = str(tmp_path / "lab.json")
    code, _out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", missing, "--batch-size", "8")
    assert code == 2 and err == f"error: cluster file {missing} does not exist\n"
    code, _out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", str(tmp_path), "--batch-size", "8")
    assert code == 2 and err == f"error: cluster file {tmp_path} is a directory\n"


# `plan --batch-size 99999999999` planned that batch, then every halved one down to one that fit: ten minutes.
@pytest.mark.parametrize("method", ["asteroid", "all"])
def test_a_hopeless_batch_size_is_refused_before_planning_it(capsys, monkeypatch, method):
    import engine.cli.plan

    monkeypatch.setattr(engine.cli.plan, "plan_compressed", lambda *a, **k: pytest.fail("planned the batch size"))
    code, _out, err = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "99999999999", "--method", method
    )
    assert code == 2 and "at batch size 99999999999 does not fit" in err and "try --batch-size" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_plan_file(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    code, _out, err = run(capsys, "simulate", "--plan", str(path))
    assert code == 2 and "not valid JSON" in err
    path.write_text(json.dumps({"method": "asteroid"}))
    code, _out, err = run(capsys, "simulate", "--plan", str(path))
    assert code == 2 and "missing field" in err


@pytest.mark.multiprocess
def test_module_entry_point_runs(profile_cache):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "plan", "--model", "nope", "--cluster", "C", "--batch-size", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "error: unknown model 'nope'; known models: "
        + ", ".join(__import__("engine.models", fromlist=["model_names"]).model_names())
        + ", or your own as FILE.py:FUNCTION"
    )


def test_plan_with_compression_records_the_level_per_boundary_and_simulates(capsys, tmp_path):
    off = plan_json(capsys, "--bandwidth-mbps", "100")
    auto = plan_json(capsys, "--bandwidth-mbps", "100", "--compression", "auto")
    assert "compression" not in off
    assert auto["predicted"]["simulated_s"] <= off["predicted"]["simulated_s"] * (1 + 1e-9)  # what both are chosen by
    assert len(auto["stages"]) > 1  # compressed links make a pipeline worth it on C at 100 Mbps
    assert len(auto["compression"]) == len(auto["stages"]) - 1
    assert all(b in ("off", 8, 4, 2) for b in auto["compression"])
    four = plan_json(capsys, "--bandwidth-mbps", "100", "--compression", "4")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(four))
    code, out, err = run(capsys, "simulate", "--plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["predicted_iteration_s"] == pytest.approx(four["predicted"]["iteration_s"])


def test_plan_with_a_16_bit_all_reduce_records_it_and_predicts_no_slower(capsys):
    off = plan_json(capsys, "--method", "dp")
    fp16 = plan_json(capsys, "--method", "dp", "--allreduce", "fp16")
    assert "allreduce" not in off and fp16["allreduce"] == "fp16"
    # data parallelism over all of C: the all-reduce of every gradient, now half the bytes
    assert fp16["predicted"]["iteration_s"] < off["predicted"]["iteration_s"]
    code, out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "64",
                         "--allreduce", "bf16")  # fmt: skip
    assert code == 0 and "stage all-reduce: bf16" in out, err


@pytest.mark.parametrize("bad", ["3", "auto:3", "fast", ""])
def test_a_bad_compression_level_is_one_line(capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "64", "--compression", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "compression" in err
