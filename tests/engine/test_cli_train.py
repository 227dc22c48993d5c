"""`python -m engine train` and `bench reproduce` at the command line: JSON schema, distributed ranks, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine.clirun import run
from workers.device import free_port


@pytest.fixture(autouse=True)
def _profiles(profile_cache):
    """The quick mobilenetv2 profile of conftest's `profile_cache`."""


def test_train_json_document(capsys, plan_file, tmp_path):
    events = tmp_path / "events.jsonl"
    code, out, err = run(
        capsys, "train", "--plan", str(plan_file), "--iterations", "2", "--json", "--events", str(events),
        "--save", str(tmp_path / "model.pt"), "--trace", str(tmp_path / "trace.json"),
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["throughput"] > 0 and len(doc["loss"]) == 2
    assert doc["iteration_s"]["measured"] > 0 and doc["iteration_s"]["predicted"] > 0
    assert doc["steps"] == 2 * 2 * 2 * 3 and doc["late_steps"] == 0  # iterations x micro-batches x F/B x devices
    kinds = [json.loads(line)["type"] for line in events.read_text().splitlines()]
    assert kinds[0] == "run-start" and kinds[-1] == "run-stop" and kinds.count("iteration") == 2
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert any(n.startswith("measured") for n in names) and "simulated (cost model)" in names
    import torch

    from engine.models import get_model

    get_model("mobilenetv2").sequential().load_state_dict(torch.load(tmp_path / "model.pt"))


def test_one_process_per_rank_with_a_rendezvous(plan_file, profile_cache):
    port = free_port()
    env = {**os.environ, "ASTEROID_CACHE_DIR": str(profile_cache)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine",
                "train",
                "--plan",
                str(plan_file),
                "--iterations",
                "2",
                "--rank",
                str(rank),
                "--rendezvous",
                f"127.0.0.1:{port}",
                "--timeout",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in range(3)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert "iteration 2/2" in outs[0][0]  # rank 0 reports the iterations


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--cluster", "C"], "train needs --model and --cluster"),
        (["train", "--model", "mobilenetv2", "--cluster", "Z"], "unknown cluster 'Z'"),
        (["train", "--plan", "missing.json"], "plan file missing.json does not exist"),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--rank", "0"], "needs both --rank and --rendezvous"),
        (["train", "--model", "nope", "--cluster", "C"], "unknown model 'nope'"),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--iterations", "0"], "must be a positive integer"),
        (["train", "--model", "mobilenetv2", "--cluster", "D", "--dataset", "nope"], "unknown dataset 'nope'"),
        (
            ["train", "--model", "mobilenetv2", "--cluster", "D", "--dataset", "cifar10", "--data-dir", "/nonexistent"],
            "CIFAR-10 not found in /nonexistent",
        ),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--timeout", "inf"], "a positive number, got inf"),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--dilation", "nan"], "a positive number, got nan"),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--slow", "nx-0@2:1e9"], "FACTOR must be a number from"),
        (
            ["train", "--model", "mobilenetv2", "--cluster", "C", "--warmup", "11"],
            "warm-up must be at most the run's 10",
        ),
        (
            ["train", "--model", "mobilenetv2", "--cluster", "C", "--freeze", "^head"],
            "names no parameter of mobilenetv2",
        ),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--freeze", "(("], "is no regular expression"),
        (["train", "--model", "mobilenetv2", "--cluster", "C", "--optimizer", "lamb"], "invalid choice: 'lamb'"),
        (["bench", "reproduce", "--clusters", "AQ"], "--clusters takes letters of ABCD"),
        (["bench", "reproduce", "--bandwidths", "fast"], "--bandwidths takes comma-separated numbers"),
        (["bench", "reproduce", "--models", "nope"], "unknown model 'nope'"),
        (["bench", "spread", "--models", "resnet50"], "--models takes some of mobilenetv2, vgg16, bert-small"),
        (["bench", "spread", "--iterations", "1"], "bench spread needs --iterations of at least 2"),
    ],
)
def test_train_errors_are_one_line(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--rank", "7", "--rendezvous", "127.0.0.1:1"], "--rank must be between 0 and 2"),
        (["--rank", "0", "--rendezvous", "nohost"], "--rendezvous must be HOST:PORT"),
        (["--model", "mobilenetv2"], "either --plan or --model/--cluster"),
    ],
)
def test_distributed_argument_errors(capsys, plan_file, extra, needle):
    code, _, err = run(capsys, "train", "--plan", str(plan_file), *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_the_recipe_flags_left_out_are_the_model_familys():
    from engine.cli.parser import build_parser
    from engine.cli.train import _resolve_recipe

    parse = lambda *a: build_parser().parse_args(["train", "--cluster", "C", "--iterations", "40", *a])  # noqa: E731
    gpt = parse("--model", "gpt-small", "--lr", "1e-3")
    _resolve_recipe(gpt, "gpt-small")
    assert (gpt.optimizer, gpt.lr, gpt.warmup, gpt.lr_schedule, gpt.clip_grad_norm) == ("adamw", 1e-3, 4, "cosine", 1.0)
    cnn = parse("--model", "mobilenetv2")
    _resolve_recipe(cnn, "mobilenetv2")
    assert (cnn.optimizer, cnn.lr, cnn.momentum, cnn.warmup, cnn.clip_grad_norm) == ("sgd", 0.05, 0.9, 0, 0.0)
