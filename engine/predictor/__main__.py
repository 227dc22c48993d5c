"""`python -m engine.predictor measure|fit`: regenerate the predictor's training set and its fitted model.

python -m engine.predictor measure            # every configuration this machine runs x every zoo model (minutes)
python -m engine.predictor measure --configs cuda --models gpt-small,resnet50
python -m engine.predictor measure --repeat --models mobilenetv2,resnet50,vgg16,gpt-small,bert-small --micro-batches 8
python -m engine.predictor measure --rounds 1   # one pass (faster, noisier; default 3 passes, median per layer)
python -m engine.predictor fit                # engine/predictor/data/predictor.pkl from measurements.json
"""

import os

# Some virtual machines advertise Intel AMX but do not let processes use it, and oneDNN's bfloat16 kernels then die
# of SIGILL; AVX-512 bfloat16 is enough. oneDNN reads this once, before its first kernel, so it is set before torch.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import argparse  # noqa: E402
import sys  # noqa: E402

from engine.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.predictor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time every layer of zoo models under this machine's configurations")
    m.add_argument("--configs", default="", help="comma-separated configurations (default: all this machine runs)")
    m.add_argument("--models", default="", help="comma-separated zoo models (default: all)")
    m.add_argument("--micro-batches", default="2,8", help="micro-batch sizes to time at (default 2,8)")
    m.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="passes over every cell, each layer's time the median of its passes (default 3)",
    )
    m.add_argument(
        "--repeat",
        action="store_true",
        help="store as a repeat measurement (bench predictor's noise floor), not as training data",
    )
    sub.add_parser("fit", help="fit the predictor on measurements.json and store it")
    args = parser.parse_args(argv)
    try:
        if args.command == "measure":
            return _measure(args)
        return _fit()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _measure(args) -> int:
    from engine.models import get_model, model_names
    from engine.predictor.configs import available, get_config
    from engine.predictor.measure import MEASUREMENTS, ROUNDS, measure

    configs = [get_config(c.strip()) for c in args.configs.split(",") if c.strip()] or [
        get_config(c) for c in available()
    ]
    missing = [c.name for c in configs if c.name not in available()]
    if missing:
        raise UserError(f"this machine cannot run configuration(s) {', '.join(missing)} (no GPU)")
    models = [m.strip() for m in args.models.split(",") if m.strip()] or model_names()
    for name in models:
        get_model(name)
    try:
        batches = tuple(int(b) for b in args.micro_batches.split(","))
    except ValueError:
        raise UserError(f"--micro-batches takes comma-separated integers, got {args.micro_batches!r}") from None
    if not batches or min(batches) < 1:
        raise UserError(f"--micro-batches must be positive, got {args.micro_batches!r}")
    rounds = ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        raise UserError(f"--rounds must be at least 1, got {rounds}")
    measure(configs, models, batches, section="repeat" if args.repeat else "configs", rounds=rounds)
    what = "repeat measurements" if args.repeat else "measurements"
    print(f"measured {len(configs)} configuration(s) x {len(models)} model(s), {rounds} pass(es): {what} in "
          f"{MEASUREMENTS}")  # fmt: skip
    return 0


def _fit() -> int:
    from engine.predictor.model import MODEL_FILE, fit_and_save

    predictor = fit_and_save()
    print(f"fitted on {predictor.rows} layer times of {len(predictor.devices)} configurations into {MODEL_FILE}")
    return 0


raise SystemExit(main())
