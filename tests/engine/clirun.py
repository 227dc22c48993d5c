"""Running `python -m engine` in-process for a test: (exit status, stdout, stderr), argparse's exits included."""

from __future__ import annotations

from engine.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
