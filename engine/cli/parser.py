"""The command line's arguments: one parser per command, each mistake reported as one line."""

from __future__ import annotations

import argparse
import math

from engine.devices import LIMITS
from engine.errors import OneLineParser, UserError
from engine.planners import PLANNERS
from engine.schedule import SCHEDULES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _float_in(text: str, low_open: bool, what: str) -> float:
    """A finite number above 0 (`low_open`) or from 0 on; nan and inf too are refused (a timeout or a dilation of inf
    is no number of seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 < value if low_open else 0 <= value) or not value < math.inf:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _float_in(text, True, "a positive number")


def _non_negative_float(text: str) -> float:
    return _float_in(text, False, "0 or more")


def _path(text: str) -> str:
    """A file or directory argument: an empty one is a mistake (a shell variable that was not set), not "none"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return text


def _compression(text: str):
    from engine.compression import parse_compression

    try:
        return parse_compression(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# How a plan's stages talk and take turns: the same arguments for plan and train.
_PIPELINE_ARGUMENTS = {
    "--compression": dict(
        type=_compression,
        default=((), False),
        metavar="off|8|4|2|auto",
        help="bits per value of the activations and gradients sent between stages (default off); auto: per "
        "boundary, the level the cost model predicts fastest (auto:8,4 limits the levels it may pick); delta:LEVEL "
        "(e.g. delta:2, delta:auto): a sample seen before sends the change of its activation since it last crossed "
        "(AQ-SGD), at that level; both ends keep its last activation, counted in the plan's memory",
    ),
    "--allreduce": dict(
        default="off",
        choices=["off", "fp16", "bf16"],
        help="the stage's gradient all-reduce in 16-bit floats (torch's DDP compression hooks; half the bytes) or "
        "float32 (default off)",
    ),
    "--schedule": dict(
        default="auto",
        choices=["auto", *SCHEDULES],
        help="the pipeline schedule: 1F1B, or zero-bubble ZB-H1 (1F1B's memory) or ZB-H2 (more activations held), "
        "whose backward is split into input and weight gradients; default auto: Asteroid simulates each and keeps "
        "the fastest that fits",
    ),
}


MODEL_HELP = (
    "a model of the zoo (see `python -m engine models`), or your own module: FILE.py:FUNCTION, a function of no "
    "arguments returning an nn.Module (with --input-shape or --seq-len)"
)


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    """The input of a user's module (FILE.py:FUNCTION): image-like tensors or token ids."""
    parser.add_argument(
        "--input-shape", metavar="C,H,W", help="your module takes float tensors of this shape per sample"
    )
    parser.add_argument("--seq-len", type=_positive_int, metavar="N", help="your module takes N token ids per sample")


def _pipeline_arguments(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    for flag, options in _PIPELINE_ARGUMENTS.items():
        if flag not in leave_out:
            parser.add_argument(flag, **options)


def _bounded(kind: type, low: float, high: float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value <= high:
            shown = [str(int(x)) if kind is int else f"{x:g}" for x in (low, high)]
            raise argparse.ArgumentTypeError(f"must be from {shown[0]} to {shown[1]}, got {text}")
        return value

    return parse


# --bandwidth-mbps: the bounds of a cluster file's bandwidth_mbps (finite: inf is no bandwidth)
_bandwidth = _bounded(float, *LIMITS["bandwidth_mbps"])


def _run_option_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per run option a job's owner sets (engine.runtime.options.settable()): --lr, --seed, --schedule ..."""
    from engine.recipe import RECIPE_OPTIONS, defaults_text
    from engine.runtime.options import settable

    for name, spec in settable().items():
        default = spec["default"] if spec["default"] != "" else "none"
        options = {"default": spec["default"], "help": f"{spec['help']} (default {default})"}
        if name in RECIPE_OPTIONS:  # the model's family's (engine.recipe.family_defaults), filled in by `train`
            options.update(default=None, help=f"{spec['help']} (default {defaults_text(name, spec['default'])})")
        if spec["choices"]:
            options["choices"] = [value for value, _ in spec["choices"]]
        elif spec["type"] is bool:  # a switch: given, it is on
            options.update(action="store_true", help=spec["help"])
        elif spec["type"] is str:
            options["metavar"] = "TEXT"
        else:
            options["type"] = _bounded(spec["type"], spec["low"], spec["high"])
            options["metavar"] = "N" if spec["type"] is int else "X"
        parser.add_argument("--" + name.replace("_", "-"), **options)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m engine", description="Plan, simulate and benchmark hybrid pipeline training."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("plan", help="plan a model on a cluster and predict its throughput")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    _input_arguments(p)
    p.add_argument("--cluster", type=_path, required=True, help="A, B, C, D or a cluster JSON file")
    p.add_argument("--batch-size", required=True, type=_positive_int, help="global batch size per iteration")
    p.add_argument("--method", default="asteroid", choices=[*PLANNERS, "all"], help="planner (default asteroid)")
    p.add_argument("--bandwidth-mbps", type=_bandwidth, help="override the cluster's link bandwidth")
    p.add_argument(
        "--optimizer",
        choices=["sgd", "adam", "adamw"],
        help="optimizer state to budget for (default adamw for transformers, sgd for other models)",
    )
    p.add_argument("--freeze", default="", metavar="REGEX", help="plan for training without the weights it names")
    p.add_argument(
        "--lora",
        type=_bounded(int, 0, 1024),
        default=0,
        metavar="RANK",
        help="plan for low-rank adapters of this rank instead of the Linear layers' weights (0: none)",
    )
    p.add_argument("--lora-targets", default="", metavar="REGEX", help="the Linear layers --lora adapts (all)")
    p.add_argument("--refresh-profile", action="store_true", help="profile the model again instead of the cache")
    p.add_argument("--json", action="store_true", help="print the plan JSON (with --method all: every plan)")
    _pipeline_arguments(p)

    s = sub.add_parser("simulate", help="simulate one iteration of a plan file (under its schedule)")
    s.add_argument("--plan", type=_path, required=True, help="a plan JSON file (from `plan --json`, or hand-edited)")
    s.add_argument("--trace", type=_path, help="write a Chrome-trace file (open in Perfetto or chrome://tracing)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")

    t = sub.add_parser(
        "train",
        help="train with one process per device: the whole cluster emulated here, or one device of a real run",
        description="Local run: --model and --cluster (planned with --method) or --plan, usually with --emulate. "
        "One device of a distributed run: --plan, --rank and --rendezvous (rank 0 hosts the rendezvous store).",
    )
    t.add_argument("--model", help=MODEL_HELP)
    _input_arguments(t)
    t.add_argument(
        "--init", type=_path, help="start from these weights: a state_dict (.pt, or .safetensors) keyed as the model"
    )
    t.add_argument("--cluster", type=_path, help="A, B, C, D or a cluster JSON file")
    t.add_argument("--batch-size", type=_positive_int, default=64, help="global batch size (default 64)")
    t.add_argument("--method", default="asteroid", choices=list(PLANNERS), help="planner (default asteroid)")
    t.add_argument("--bandwidth-mbps", type=_bandwidth, help="override the cluster's link bandwidth")
    t.add_argument("--plan", type=_path, help="train this plan file instead of planning")
    t.add_argument("--emulate", action="store_true", help="emulate the plan's devices here (time dilation)")
    t.add_argument("--dilation", type=_positive_float, help="wall seconds per device second (default: calibrated)")
    t.add_argument("--iterations", type=_positive_int, default=10, help="optimizer steps (default 10)")
    t.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (default), digits (images) or pytext (language models), bundled; cifar10 (from --data-dir); "
        "images (--data-dir DIR, one sub-folder per class) or text (--data-dir FILE)",
    )
    t.add_argument(
        "--data-dir",
        type=_path,
        help="cifar10's folder (default $ASTEROID_DATA_DIR), the images' folder or the text file",
    )
    t.add_argument(
        "--eval-samples", type=_positive_int, default=512, help="held-out samples scored, in whole batches (512)"
    )
    _pipeline_arguments(t, leave_out=("--schedule",))  # a run option (below): re-plans keep to it too
    _run_option_arguments(t)
    t.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds before a silent device is dead")
    t.add_argument(
        "--save",
        type=_path,
        help="write the trained model as one state_dict keyed as the model (safetensors when FILE ends so, else "
        "torch.save): your module's load_state_dict(..., strict=True) reads it",
    )
    t.add_argument("--events", type=_path, help="write every event as a JSON line to this file (replaced if it exists)")
    t.add_argument(
        "--trace", type=_path, help="write a Chrome trace: the last iteration measured, above the simulated one"
    )
    t.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    t.add_argument("--rank", type=int, help="this device's rank in the plan's device order (distributed run)")
    t.add_argument("--rendezvous", help="HOST:PORT of the rendezvous store (distributed run)")
    t.add_argument("--generation", type=int, default=0, help="rendezvous generation (a new one per re-plan)")
    t.add_argument(
        "--trust-lan", action="store_true",
        help="allow a --rendezvous address other than loopback: its store is unauthenticated (docs/training.md)",
    )  # fmt: skip
    f = t.add_argument_group("fault tolerance (a local run: the launcher is the coordinator)")
    f.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="DEV@IT[:PHASE]",
        help="SIGKILL device DEV in iteration IT (phase forward, backward, all-reduce, send or replica)",
    )
    f.add_argument(
        "--leave",
        action="append",
        default=[],
        metavar="DEV@IT",
        help="device DEV finishes iteration IT, hands over its layers and leaves",
    )
    f.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="KIND@IT",
        help="a new device of KIND (nano, tx2, nx, ...) joins after iteration IT",
    )
    f.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="DEV@IT:FACTOR",
        help="device DEV runs FACTOR times slower from iteration IT (the run re-partitions)",
    )
    f.add_argument(
        "--replicate-every",
        type=int,
        metavar="K",
        help="copy each stage's layers to a neighbour and the coordinator every K iterations "
        "(default: the period that costs at most 4%% of the predicted throughput; 0: never)",
    )
    f.add_argument(
        "--run-dir", type=_path, help="where the coordinator keeps the central replica (default runs/<time>)"
    )
    f.add_argument(
        "--resume", type=_path, metavar="DIR", help="continue the run whose coordinator died, from DIR's replica"
    )
    f.add_argument(
        "--detect",
        type=_positive_float,
        default=2.0,
        help="seconds without a heartbeat before a device is lost (default 2)",
    )

    b = sub.add_parser("bench", help="run a benchmark and print its tables")
    b.add_argument(
        "name",
        choices=[
            "planner",
            "reproduce",
            "recovery",
            "compression",
            "predictor",
            "spread",
            "ideal",
            "schedule",
            "usermodels",
            "gpu",
        ],
        help="planner: planning time and predicted throughput; reproduce: train every method on clusters A-D; "
        "recovery: recovery from killed devices against a checkpoint-restart baseline; compression: training at "
        "each compression level between stages against none; predictor: latency prediction for an unseen device, leave "
        "one measured configuration out; spread: FTPipeHD's setting (an NX beside boards 10x slower), Asteroid, "
        "FTPipeHD and the even pipeline trained; ideal: where the device time of Asteroid's plans goes against the "
        "ideal, by batch size (simulated; default clusters B and C at 1000 Mbps); schedule: 1F1B against the "
        "zero-bubble schedules on Asteroid's plans, simulated and trained (default mobilenetv2 and gpt-small on B "
        "and C at 1000 Mbps; --quick: simulated only); usermodels: a lab's own models (examples/), captured, planned "
        "on A-D and trained on C (--quick: not trained); gpu: the GPU check (make gpu-check): pipelines equal to one "
        "process, a recovery, measured against predicted time and memory, GPU against CPU, every process on the "
        "GPU (--device cpu: the same on the CPU)",
    )
    b.add_argument("--quick", action="store_true", help="a small grid, for a fast look")
    b.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="gpu: where the check computes")
    b.add_argument("--timeout", type=_positive_float, default=60.0, help="planner: seconds allowed per cell")
    b.add_argument("--output", type=_path, help="also write the markdown report to this file")
    b.add_argument(
        "--clusters",
        default=None,
        help="reproduce, recovery, compression, ideal, schedule: clusters to run (default ABCD; compression: C; ideal, "
        "schedule: BC)",
    )
    b.add_argument(
        "--models",
        help="reproduce, recovery, compression, spread, ideal, schedule: comma-separated models (default: the paper's "
        "four; compression, schedule: mobilenetv2,gpt-small; spread: mobilenetv2,vgg16,bert-small)",
    )
    b.add_argument(
        "--bandwidths",
        default="1000,100",
        help="reproduce, recovery, compression, spread: comma-separated Mbps (default 1000,100; spread: 1000)",
    )
    b.add_argument("--methods", help="reproduce: comma-separated methods (default: all five)")
    b.add_argument(
        "--levels",
        help="compression: comma-separated --compression forms to train (default off,8,4,2,auto,delta:4,delta:2)",
    )
    b.add_argument(
        "--iterations",
        type=_positive_int,
        help="reproduce: iterations per run (default 2); spread, schedule: per run (default 4); compression: of the "
        "accuracy "
        "runs (60 for mobilenetv2, 20 "
        "for gpt-small); recovery: iterations per run (default 10, "
        "the failure in iteration 6, or the one before the last in shorter runs)",
    )
    b.add_argument(
        "--scenarios",
        help="recovery: comma-separated failures among one (tx2-1), nx (the only NX of a cluster), stage (the device "
        "of a single-device stage), two (two devices at once); default all (--quick: one)",
    )
    b.add_argument(
        "--replicate-every",
        type=_positive_int,
        help="recovery: replication period K of ours, also the restart's checkpoint period (default 2)",
    )
    b.add_argument("--batch-size", type=_positive_int, default=32, help="recovery: global batch size (default 32)")
    b.add_argument(
        "--budget",
        type=_non_negative_float,
        default=120.0,
        help="reproduce: wall seconds a run may take, 0 for no limit (120)",
    )
    b.add_argument(
        "--figure",
        type=_path,
        help="reproduce, recovery, compression, predictor: write the Plotly figure to this path (.html, and .png if "
        "possible)",
    )
    b.add_argument(
        "--record",
        type=_path,
        help="reproduce, compression: keep every run as JSON in this file (rewritten after each run)",
    )
    b.add_argument(
        "--from-record",
        type=_path,
        help="reproduce, compression: make the report from records instead of training (comma-separated; later "
        "runs of the same cell and method replace earlier ones)",
    )

    sub.add_parser("models", help="list the model zoo")
    return parser
