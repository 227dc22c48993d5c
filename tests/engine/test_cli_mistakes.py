"""User mistakes at the command line (env vars, cluster and plan files, flags): one `error:` line, exit 2."""

from __future__ import annotations

import json

import pytest

from tests.engine.clirun import run
from tests.engine.runtime.helpers import cluster_of


def one_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") or ": error: " in err, err


@pytest.mark.parametrize("where", ["file", "under-a-file", "missing-root"])
def test_a_cache_dir_that_cannot_be_written_is_one_line(capsys, tmp_path, monkeypatch, where):
    afile = tmp_path / "somefile"
    afile.write_text("")
    value = {"file": afile, "under-a-file": afile / "sub", "missing-root": "/proc/nope"}[where]
    monkeypatch.setenv("ASTEROID_CACHE_DIR", str(value))
    code, _, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "32")
    one_line(code, err, f"error: ASTEROID_CACHE_DIR={value} is not a writable directory (")


def write(tmp_path, doc, name="doc.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(
    "doc, needle",
    [
        (
            {"bandwith_mbps": 1, "devices": [{"name": "a", "kind": "nano"}]},
            "error: cluster file: unknown field 'bandwith_mbps' (known: name, bandwidth_mbps,",
        ),
        (
            {"devices": [{"name": "a", "kind": "nano", "memroy_gb": 1}, {"name": "b", "kind": "tx2"}]},
            "error: cluster file: devices[0]: unknown field 'memroy_gb' (known: name, kind, memory_gb,",
        ),
    ],
)
def test_unknown_fields_of_a_cluster_file_are_refused(capsys, tmp_path, profile_cache, doc, needle):
    code, _, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", write(tmp_path, doc), "--batch-size", "8")
    one_line(code, err, needle)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.update(schedul="zb-h1"), "plan: unknown field 'schedul'"),
        (lambda d: d.update(method="magic"), "plan: field 'method' must be one of asteroid,"),
        (lambda d: d["stages"][0].update(layer=[0, 9]), "plan: stages[0]: unknown field 'layer'"),
        (lambda d: d["stages"][1]["devices"][0].update(sample=3), "plan: stages[1].devices[0]: unknown field 'sample'"),
        (lambda d: d["cluster"]["devices"][0].update(gflop=1), "cluster file: devices[0]: unknown field 'gflop'"),
    ],
)
def test_unknown_fields_and_methods_of_a_plan_file_are_refused(capsys, plan_file, change, needle):
    doc = json.loads(plan_file.read_text())
    change(doc)
    plan_file.write_text(json.dumps(doc))
    code, _, err = run(capsys, "simulate", "--plan", str(plan_file))
    one_line(code, err, needle)


def test_every_plan_the_code_writes_still_loads(capsys, tmp_path, profile_cache):
    from engine.plan import METHODS, Plan
    from engine.planners import PLANNERS

    assert set(PLANNERS) <= set(METHODS)
    code, out, err = run(
        capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "32", "--method", "all", "--json"
    )
    assert code == 0, err
    for doc in json.loads(out)["plans"].values():
        if "error" not in doc:
            Plan.from_dict(doc, keep_prediction=True)
    code, out, err = run(capsys, "plan", "--model", "mobilenetv2", "--cluster", "C", "--batch-size", "32", "--json")
    assert code == 0, err
    code, _, err = run(capsys, "simulate", "--plan", write(tmp_path, json.loads(out)))
    assert code == 0, err


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--batch-size", "16", "a plan file sets its own batch size (its 'batch_size' field): drop --batch-size"),
        ("--method", "dp", "a plan file sets its own method (its 'method' field): drop --method"),
        ("--bandwidth-mbps", "10", "its 'bandwidth_mbps' field): drop --bandwidth-mbps"),
        ("--schedule", "zb-h1", "drop --schedule"),
    ],
)
def test_flags_a_plan_file_overrides_are_refused(capsys, plan_file, flag, value, needle):
    code, _, err = run(capsys, "train", "--plan", str(plan_file), flag, value)
    one_line(code, err, needle)


@pytest.fixture
def run_dir(tmp_path):
    import torch

    from engine.runtime.options import RunOptions

    folder = tmp_path / "run"
    folder.mkdir()
    doc = {
        "model": "mobilenetv2", "method": "asteroid", "batch_size": 8, "allreduce": "off", "replicate_every": 2,
        "cluster": cluster_of("nx", "tx2").to_dict(), "options": RunOptions(iterations=6).to_dict(),
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps(doc))
    torch.save({"iteration": 2, "layers": {}, "devices": ["nx-0"], "generation": 0}, folder / "central.pt")
    return folder


@pytest.mark.parametrize(
    "extra", [["--batch-size", "16"], ["--iterations", "12"], ["--lr", "0.1"], ["--method", "dp"], ["--seed", "3"]]
)
def test_flags_a_resumed_run_ignores_are_refused(capsys, run_dir, extra):
    code, _, err = run(capsys, "train", "--resume", str(run_dir), *extra)
    one_line(code, err, f"--resume continues the run in {run_dir} with its own settings: drop {extra[0]}")


def test_a_resume_flag_equal_to_the_runs_own_is_no_mistake(run_dir):
    from engine.cli.parser import build_parser
    from engine.cli.train import _refuse_resume_overrides

    doc = json.loads((run_dir / "run.json").read_text())
    args = build_parser().parse_args(["train", "--resume", str(run_dir), "--iterations", "6", "--batch-size", "8"])
    _refuse_resume_overrides(args, doc)  # no error


@pytest.mark.parametrize("flag", ["--save", "--trace", "--run-dir"])
def test_local_only_outputs_are_refused_with_rank(capsys, plan_file, tmp_path, flag):
    code, _, err = run(
        capsys, "train", "--plan", str(plan_file), "--rank", "0", "--rendezvous", "127.0.0.1:29555",
        flag, str(tmp_path / "out"),
    )  # fmt: skip
    one_line(code, err, f"error: {flag} needs a local run (no --rank)")


@pytest.mark.parametrize(
    "value, needle",
    [
        ("127.0.0.1:99999", "--rendezvous: port must be 1-65535, got 99999"),
        ("127.0.0.1:0", "--rendezvous: port must be 1-65535, got 0"),
        ("127.0.0.1", "--rendezvous must be HOST:PORT"),
        (":29555", "--rendezvous must be HOST:PORT"),
    ],
)
def test_a_bad_rendezvous_is_refused_before_anything_starts(capsys, plan_file, value, needle):
    code, _, err = run(capsys, "train", "--plan", str(plan_file), "--rank", "0", "--rendezvous", value)
    one_line(code, err, needle)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--plan", ""],
        ["train", "--model", "mobilenetv2", "--cluster", ""],
        ["plan", "--model", "mobilenetv2", "--cluster", "", "--batch-size", "8"],
        ["simulate", "--plan", ""],
        ["train", "--model", "mobilenetv2", "--cluster", "C", "--trace", ""],
        ["train", "--model", "mobilenetv2", "--cluster", "C", "--save", ""],
        ["train", "--model", "mobilenetv2", "--cluster", "C", "--events", ""],
        ["train", "--resume", ""],
        ["bench", "planner", "--output", ""],
    ],
)
def test_an_empty_path_is_refused(capsys, argv):
    code, _, err = run(capsys, *argv)
    flag = argv[argv.index("") - 1]
    one_line(code, err, f"argument {flag}: empty path")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "mobilenetv2", "--cluster", "C", "--save", "X", "--events", "X", "--trace", "X"],
        ["train", "--model", "mobilenetv2", "--cluster", "C", "--save", "X", "--trace", "./X"],
        ["bench", "reproduce", "--output", "X", "--record", "X"],
    ],
)
def test_one_path_for_two_outputs_is_refused(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    one_line(code, err, "name the same file")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_negative_budget_is_refused(capsys, value):
    code, _, err = run(capsys, "bench", "reproduce", "--budget", value)
    one_line(code, err, "argument --budget: must be 0 or more")


def test_a_batch_larger_than_the_dataset_is_refused_before_planning(capsys, monkeypatch, profile_cache):
    import engine.cli.train as train_cli

    def no_planning(*a, **k):
        raise AssertionError("planned")

    monkeypatch.setattr(train_cli, "fitting_plan", no_planning)
    code, _, err = run(
        capsys, "train", "--model", "mobilenetv2", "--cluster", "B", "--batch-size", "4096", "--emulate",
        "--iterations", "1",
    )  # fmt: skip
    one_line(code, err, "dataset 'synthetic' has 2048 samples, fewer than one batch of 4096: lower --batch-size")


def test_losing_every_device_suggests_resume_only_with_a_central_replica(tmp_path):
    from types import SimpleNamespace

    from engine.runtime.membership import Membership

    run = SimpleNamespace(run_dir=tmp_path, central_done=0)
    note = Membership._central_note(run, resumable=True)
    assert "--resume" not in note and "must start again" in note
    assert "--resume" not in Membership._central_note(SimpleNamespace(run_dir=None, central_done=0), True)
    (tmp_path / "central.pt").write_bytes(b"x")
    run.central_done = 4
    note = Membership._central_note(run, resumable=True)
    assert note == f"the central replica as of iteration 4 is in {tmp_path}: continue with --resume {tmp_path}"


def test_a_rendezvous_on_the_lan_is_refused_unless_the_lan_is_trusted(capsys, plan_file):
    """Rank 0's store authenticates no one: a LAN address is said to be exposed, before anything starts."""
    code, _, err = run(capsys, "train", "--plan", str(plan_file), "--rank", "1", "--rendezvous", "198.18.9.9:29555")
    assert code == 2 and "authenticates no one" in err and "--trust-lan" in err and len(err.strip().splitlines()) == 1
