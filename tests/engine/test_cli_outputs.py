"""Output paths (engine/cli/outputs.py): every command's --save, --events, --trace, --output ... checked before
any work, each mistake one line."""

from __future__ import annotations

import os

import pytest

import engine.bench
import engine.cli.plan
import engine.cli.train
from engine.cli import main
from engine.cli.outputs import check_output, check_output_dir
from engine.errors import UserError


@pytest.fixture(autouse=True)
def _profiles(profile_cache):
    """The quick mobilenetv2 profile of conftest's `profile_cache`."""


def test_a_file_to_write(tmp_path):
    check_output("--save", str(tmp_path / "m.pt"))
    check_output("--save", None)  # not asked for
    (tmp_path / "old.pt").write_text("x")
    check_output("--save", str(tmp_path / "old.pt"))  # overwritten
    with pytest.raises(UserError, match=f"^--save {tmp_path} is a directory; give a file name$"):
        check_output("--save", str(tmp_path))
    with pytest.raises(UserError, match=f"^--save {tmp_path}/no/m.pt: directory {tmp_path}/no does not exist$"):
        check_output("--save", str(tmp_path / "no" / "m.pt"))
    with pytest.raises(UserError, match=f"^--save {tmp_path}/old.pt/m.pt: {tmp_path}/old.pt is not a directory$"):
        check_output("--save", str(tmp_path / "old.pt" / "m.pt"))
    check_output("--figure", str(tmp_path / "new" / "deeper" / "fig.html"), make_dirs=True)  # made when written
    with pytest.raises(UserError, match="is not a directory"):
        check_output("--figure", str(tmp_path / "old.pt" / "new" / "fig.html"), make_dirs=True)


def test_a_directory_to_write_in(tmp_path):
    check_output_dir("--run-dir", str(tmp_path))
    check_output_dir("--run-dir", str(tmp_path / "runs" / "one"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="^--run-dir .*file is a file, not a directory$"):
        check_output_dir("--run-dir", str(tmp_path / "file"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_directory_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(UserError, match="no permission to write in"):
        check_output("--events", str(locked / "events.jsonl"))


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _no_work(monkeypatch):
    """Planning, training and benchmarking fail the test: a path mistake must be reported before them."""
    for module, name in ((engine.cli.train, "fitting_plan"), (engine.cli.plan, "_read_plan"), (engine.bench, "run")):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran before the check"))


# `train --save /nonexistent/dir/m.pt` trained the whole run, then torch.save raised; `--events DIR` raised
# IsADirectoryError; `--trace /nonexistent/t.json` was refused only after training.
@pytest.mark.parametrize(
    "option, path, needle",
    [
        ("--save", "/nonexistent/dir/m.pt", "--save /nonexistent/dir/m.pt: directory /nonexistent/dir does not exist"),
        ("--events", "{tmp}", "--events {tmp} is a directory; give a file name"),
        ("--trace", "/nonexistent/t.json", "--trace /nonexistent/t.json: directory /nonexistent does not exist"),
        ("--run-dir", "{tmp}/file", "--run-dir {tmp}/file is a file, not a directory"),
    ],
)
def test_train_checks_its_output_paths_before_planning(capsys, monkeypatch, tmp_path, option, path, needle):
    _no_work(monkeypatch)
    (tmp_path / "file").write_text("x")
    path, needle = path.format(tmp=tmp_path), needle.format(tmp=tmp_path)
    code, err = run(capsys, "train", "--model", "mobilenetv2", "--cluster", "C", "--iterations", "1", option, path)
    assert code == 2 and err == f"error: {needle}\n"


def test_simulate_checks_its_trace_before_reading_the_plan(capsys, monkeypatch, tmp_path):
    _no_work(monkeypatch)
    code, err = run(capsys, "simulate", "--plan", "plan.json", "--trace", str(tmp_path))
    assert code == 2 and err == f"error: --trace {tmp_path} is a directory; give a file name\n"


@pytest.mark.parametrize(
    "option, path, needle",
    [
        ("--output", "/nonexistent/report.md", "--output /nonexistent/report.md: directory /nonexistent does not"),
        ("--record", "{tmp}", "--record {tmp} is a directory"),
        ("--figure", "{tmp}/file/fig", "--figure {tmp}/file/fig.html: {tmp}/file is not a directory"),
    ],
)
def test_bench_checks_its_output_paths_before_running(capsys, monkeypatch, tmp_path, option, path, needle):
    _no_work(monkeypatch)
    (tmp_path / "file").write_text("x")
    path, needle = path.format(tmp=tmp_path), needle.format(tmp=tmp_path)
    code, err = run(capsys, "bench", "reproduce", "--quick", option, path)
    assert code == 2 and err.startswith(f"error: {needle}") and len(err.splitlines()) == 1
