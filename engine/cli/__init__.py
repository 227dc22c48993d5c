"""Command line: `python -m engine plan | simulate | train | bench | models` (the parser in parser.py, the
commands in plan.py and train.py).

python -m engine plan --model mobilenetv2 --cluster C --batch-size 128 --method all
python -m engine plan --model resnet50 --cluster my-lab.json --batch-size 64 --json > plan.json
python -m engine simulate --plan plan.json --trace trace.json
python -m engine train --model mobilenetv2 --cluster C --emulate --iterations 20
python -m engine bench planner
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.outputs import check_distinct, check_output
from engine.cli.parser import build_parser
from engine.cli.plan import cmd_plan, cmd_simulate
from engine.cli.train import cmd_train
from engine.errors import UserError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "model", None):  # a module in a file: its canonical reference (absolute path, input)
            from engine.models.source import reference

            args.model = reference(args.model, args.input_shape, args.seq_len, getattr(args, "dataset", ""))
        commands = {"plan": cmd_plan, "simulate": cmd_simulate, "train": cmd_train, "bench": cmd_bench}
        return {**commands, "models": cmd_models}[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_bench(args: argparse.Namespace) -> int:
    from engine import bench

    check_output("--output", args.output)
    check_output("--record", args.record)
    figure = str(Path(args.figure).with_suffix(".html")) if args.figure else None
    if figure:  # PREFIX.html (and .png); its directory is made
        check_output("--figure", figure, make_dirs=True)
    check_distinct((("--output", args.output), ("--record", args.record), ("--figure", figure)))
    report = bench.run(args)
    print(report)
    if args.output:
        try:
            Path(args.output).write_text(report + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc}") from None
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from engine.models import MODELS

    width = max(map(len, MODELS))
    for name, spec in MODELS.items():
        shape = "x".join(map(str, spec.input_shape))
        print(f"{name.ljust(width)}  {spec.family:<11}  {spec.task:<17}  input {shape:<10}  {spec.description}")
    return 0
