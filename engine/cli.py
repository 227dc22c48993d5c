"""Command line: `python -m engine plan | simulate | train | bench | models` (contracts in DESIGN.md).

python -m engine plan --model mobilenetv2 --cluster C --batch-size 128 --method all
python -m engine plan --model resnet50 --cluster my-lab.json --batch-size 64 --json > plan.json
python -m engine simulate --plan plan.json --trace trace.json
python -m engine train --model mobilenetv2 --cluster C --emulate --iterations 20
python -m engine bench planner
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine.costmodel import ideal_throughput
from engine.devices import Cluster, load_cluster
from engine.errors import UserError
from engine.plan import Plan
from engine.planners import COMPARED, PLANNERS, NoFeasiblePlan, Problem
from engine.planners.levels import plan_compressed
from engine.schedule import SCHEDULES


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _compression(text: str) -> tuple[tuple[int, ...], bool]:
    from engine.compression import parse_compression

    try:
        return parse_compression(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _compression_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        type=_compression,
        default=((), False),
        metavar="off|8|4|2|auto",
        help="bits per value of the activations and gradients sent between stages (default off); auto: per "
        "boundary, the level the cost model predicts fastest (auto:8,4 limits the levels it may pick)",
    )


def _allreduce_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allreduce",
        default="off",
        choices=["off", "fp16", "bf16"],
        help="the stage's gradient all-reduce in 16-bit floats (torch's DDP compression hooks; half the bytes) or "
        "float32 (default off)",
    )


def _schedule_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule",
        default="auto",
        choices=["auto", *SCHEDULES],
        help="the pipeline schedule: 1F1B, or zero-bubble ZB-H1 (1F1B's memory) or ZB-H2 (more activations held), "
        "whose backward is split into input and weight gradients; default auto: Asteroid simulates each and keeps "
        "the fastest that fits",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="Plan, simulate and benchmark hybrid pipeline training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan a model on a cluster and predict its throughput")
    p.add_argument("--model", required=True, help="a model of the zoo (see `python -m engine models`)")
    p.add_argument("--cluster", required=True, help="A, B, C, D or a cluster JSON file")
    p.add_argument("--batch-size", required=True, type=_positive_int, help="global batch size per iteration")
    p.add_argument("--method", default="asteroid", choices=[*PLANNERS, "all"], help="planner (default asteroid)")
    p.add_argument("--bandwidth-mbps", type=_positive_float, help="override the cluster's link bandwidth")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"], help="optimizer state to budget for")
    p.add_argument("--refresh-profile", action="store_true", help="profile the model again instead of the cache")
    p.add_argument("--json", action="store_true", help="print the plan JSON (with --method all: every plan)")
    _compression_argument(p)
    _allreduce_argument(p)
    _schedule_argument(p)

    s = sub.add_parser("simulate", help="simulate one iteration of a plan file (under its schedule)")
    s.add_argument("--plan", required=True, help="a plan JSON file (from `plan --json`, or hand-edited)")
    s.add_argument("--trace", help="write a Chrome-trace file (open in Perfetto or chrome://tracing)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")

    t = sub.add_parser(
        "train",
        help="train with one process per device: the whole cluster emulated here, or one device of a real run",
        description="Local run: --model and --cluster (planned with --method) or --plan, usually with --emulate. "
        "One device of a distributed run: --plan, --rank and --rendezvous (rank 0 hosts the rendezvous store).",
    )
    t.add_argument("--model", help="a model of the zoo")
    t.add_argument("--cluster", help="A, B, C, D or a cluster JSON file")
    t.add_argument("--batch-size", type=_positive_int, default=64, help="global batch size (default 64)")
    t.add_argument("--method", default="asteroid", choices=list(PLANNERS), help="planner (default asteroid)")
    t.add_argument("--bandwidth-mbps", type=_positive_float, help="override the cluster's link bandwidth")
    t.add_argument("--plan", help="train this plan file instead of planning")
    t.add_argument("--emulate", action="store_true", help="emulate the plan's devices here (time dilation)")
    t.add_argument("--dilation", type=_positive_float, help="wall seconds per device second (default: calibrated)")
    t.add_argument("--iterations", type=_positive_int, default=10, help="optimizer steps (default 10)")
    t.add_argument("--lr", type=_positive_float, default=0.05, help="SGD learning rate (default 0.05)")
    t.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (default), digits (images) or pytext (language models), bundled; cifar10 (from --data-dir); "
        "images (--data-dir DIR, one sub-folder per class) or text (--data-dir FILE)",
    )
    t.add_argument(
        "--data-dir", help="cifar10's folder (default $ASTEROID_DATA_DIR), the images' folder or the text file"
    )
    t.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="score the dataset's held-out split every N iterations and after the last (default 0: never)",
    )
    t.add_argument(
        "--eval-samples", type=_positive_int, default=512, help="held-out samples scored, in whole batches (512)"
    )
    _compression_argument(t)
    _allreduce_argument(t)
    _schedule_argument(t)
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch order")
    t.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds before a silent device is dead")
    t.add_argument("--save", help="write the trained model as one state_dict (torch.save) to this file")
    t.add_argument("--events", help="append every event as a JSON line to this file")
    t.add_argument("--trace", help="write a Chrome trace: the last iteration measured, above the simulated one")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    t.add_argument("--rank", type=int, help="this device's rank in the plan's device order (distributed run)")
    t.add_argument("--rendezvous", help="HOST:PORT of the rendezvous store (distributed run)")
    t.add_argument("--generation", type=int, default=0, help="rendezvous generation (a new one per re-plan)")
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
    f.add_argument("--run-dir", help="where the coordinator keeps the central replica (default runs/<time>)")
    f.add_argument("--resume", metavar="DIR", help="continue the run whose coordinator died, from DIR's replica")
    f.add_argument(
        "--detect",
        type=_positive_float,
        default=2.0,
        help="seconds without a heartbeat before a device is lost (default 2)",
    )

    b = sub.add_parser("bench", help="run a benchmark and print its tables")
    b.add_argument(
        "name",
        choices=["planner", "reproduce", "recovery", "compression", "predictor", "spread", "ideal", "schedule"],
        help="planner: planning time and predicted throughput; reproduce: train every method on clusters A-D; "
        "recovery: recovery from killed devices against a checkpoint-restart baseline; compression: training at "
        "each compression level between stages against none; predictor: latency prediction for an unseen device, leave "
        "one measured configuration out; spread: FTPipeHD's setting (an NX beside boards 10x slower), Asteroid, "
        "FTPipeHD and the even pipeline trained; ideal: where the device time of Asteroid's plans goes against the "
        "ideal, by batch size (simulated; default clusters B and C at 1000 Mbps); schedule: 1F1B against the "
        "zero-bubble schedules on Asteroid's plans, simulated and trained (default mobilenetv2 and gpt-small on B "
        "and C at 1000 Mbps; --quick: simulated only)",
    )
    b.add_argument("--quick", action="store_true", help="a small grid, for a fast look")
    b.add_argument("--timeout", type=_positive_float, default=60.0, help="planner: seconds allowed per cell")
    b.add_argument("--output", help="also write the markdown report to this file")
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
        "--budget", type=float, default=120.0, help="reproduce: wall seconds a run may take, 0 for no limit (120)"
    )
    b.add_argument(
        "--figure",
        help="reproduce, recovery, compression, predictor: write the Plotly figure to this path (.html, and .png if "
        "possible)",
    )
    b.add_argument(
        "--record", help="reproduce, compression: keep every run as JSON in this file (rewritten after each run)"
    )
    b.add_argument(
        "--from-record",
        help="reproduce, compression: make the report from records instead of training (comma-separated; later "
        "runs of the same cell and method replace earlier ones)",
    )

    sub.add_parser("models", help="list the model zoo")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"plan": cmd_plan, "simulate": cmd_simulate, "train": cmd_train, "bench": cmd_bench}
        return {**commands, "models": cmd_models}[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.tables import comparison_table, plan_table
    from engine.workloads import workload

    cluster = load_cluster(args.cluster, args.bandwidth_mbps)
    w = workload(args.model, refresh=args.refresh_profile, optimizer=args.optimizer, cluster=cluster)
    problem = Problem(w, cluster, args.batch_size, allreduce=args.allreduce, schedule=args.schedule)
    if args.method != "all":
        plan = fitting_plan(args.method, problem, args.compression)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan_table(plan))
        return 0
    results: dict[str, Plan | str] = {}
    for method in COMPARED:
        try:
            results[method] = plan_compressed(method, problem, *args.compression, progress=sys.stderr.isatty())
        except NoFeasiblePlan as exc:
            if method == "asteroid":
                raise UserError(infeasible_message(problem, method)) from None
            results[method] = f"no plan: {exc}"
    ideal = ideal_throughput(w, cluster)
    if args.json:
        doc = {
            "model": w.model,
            "batch_size": args.batch_size,
            "cluster": cluster.to_dict(),
            "ideal_throughput": ideal,
            "plans": {m: r.to_dict() if isinstance(r, Plan) else {"error": r} for m, r in results.items()},
        }
        print(json.dumps(doc, indent=2))
    else:
        print(comparison_table(results, ideal))
        print()
        print(plan_table(results["asteroid"]))
    return 0


def fitting_plan(method: str, problem: Problem, compression: tuple[tuple[int, ...], bool] = ((), False)) -> Plan:
    """The method's plan (at the `--compression` levels), or a UserError saying what does not fit and which
    batch size would."""
    try:
        plan = plan_compressed(method, problem, *compression, progress=sys.stderr.isatty())
    except NoFeasiblePlan:
        raise UserError(infeasible_message(problem, method)) from None
    if not plan.predicted.fits:
        raise UserError(infeasible_message(problem, method))
    return plan


def infeasible_message(problem: Problem, method: str) -> str:
    """Say what does not fit, and the largest batch size (halving) the method can offer instead."""
    from engine.planners.feasibility import diagnose

    why = diagnose(problem, method)
    if why.fitting_batch_size is None:
        return f"{why.summary}; it does not fit even at batch size 1"
    n = why.fitting_batch_size
    return f"{why.summary}; the largest batch size that fits is about {n}: try --batch-size {n}"


def cmd_simulate(args: argparse.Namespace) -> int:
    from engine.simulator import simulate
    from engine.tables import simulation_table
    from engine.trace import chrome_trace
    from engine.workloads import workload

    plan = _read_plan(args.plan)
    sim = simulate(plan, workload(plan.model, cluster=plan.cluster))
    if args.trace:
        trace = chrome_trace(list(sim.events), plan.device_names, f"{plan.method} {plan.model}")
        try:
            Path(args.trace).write_text(json.dumps(trace))
        except OSError as exc:
            raise UserError(f"cannot write trace {args.trace}: {exc}") from None
    print(json.dumps(sim.to_dict(), indent=2) if args.json else simulation_table(plan, sim))
    if args.trace and not args.json:
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _read_plan(arg: str) -> Plan:
    """A plan file; every problem with it is one line."""
    path = Path(arg)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"plan file {arg} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read plan file {arg}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"plan file {arg} is not valid JSON: {exc}") from None
    return Plan.from_dict(doc)


def cmd_train(args: argparse.Namespace) -> int:
    from engine.compression import compression_text, parse_compression
    from engine.runtime.launcher import RunOptions, save_events, train
    from engine.tables import CHANGE_LINES, change_line, eval_line, iteration_line, run_summary
    from engine.trace import chrome_trace, side_by_side
    from engine.workloads import workload

    if (args.rank is None) != (args.rendezvous is None):
        raise UserError("a distributed run needs both --rank and --rendezvous")
    from engine.runtime.faults import FaultArgs

    faults = FaultArgs(args.fail, args.leave, args.join, args.slow).parse()
    if args.replicate_every is not None and args.replicate_every < 0:
        raise UserError(f"--replicate-every must be 0 or more, got {args.replicate_every}")
    resume = None
    if args.resume:
        from engine.runtime.central import load_resume

        if args.plan or args.model or args.cluster:
            raise UserError("--resume continues the run in DIR: give no --plan, --model or --cluster")
        doc, resume = load_resume(Path(args.resume))
        cluster = Cluster.from_dict(doc["cluster"])
        cluster = Cluster(
            tuple(d for d in cluster.devices if d.name in resume["devices"]),
            cluster.bandwidth_mbps, cluster.latency_ms, cluster.name,
        )  # fmt: skip
        w = workload(doc["model"], cluster=cluster)
        method = doc["method"] if doc["method"] in PLANNERS else "asteroid"
        options = RunOptions.from_dict(doc["options"])
        allowed = parse_compression(options.compression or "off")
        problem = Problem(w, cluster, doc["batch_size"], allreduce=doc.get("allreduce", "off"))
        plan = fitting_plan(method, problem, allowed)
        args.iterations, args.replicate_every = options.iterations, doc["replicate_every"]
        args.run_dir = args.resume
        if not args.json:
            print(f"resuming {doc['model']} in {args.resume} from iteration {resume['iteration']} "
                  f"on {len(plan.device_names)} devices", file=sys.stderr)  # fmt: skip
    elif args.plan:
        if args.model or args.cluster:
            raise UserError("give either --plan or --model/--cluster, not both")
        if args.compression[0]:
            raise UserError("a plan file sets its own compression (its 'compression' field): drop --compression")
        if args.allreduce != "off":
            raise UserError("a plan file sets its own all-reduce format (its 'allreduce' field): drop --allreduce")
        if args.schedule != "auto":
            raise UserError("a plan file sets its own schedule (its 'schedule' field): drop --schedule")
        plan = _read_plan(args.plan)
        w = workload(plan.model, cluster=plan.cluster)
    else:
        if not (args.model and args.cluster):
            raise UserError("train needs --model and --cluster (or --plan)")
        if args.rank is not None:
            raise UserError("a distributed run trains a plan file: pass --plan (every device the same)")
        cluster = load_cluster(args.cluster, args.bandwidth_mbps)
        w = workload(args.model, cluster=cluster)
        problem = Problem(w, cluster, args.batch_size, allreduce=args.allreduce, schedule=args.schedule)
        plan = fitting_plan(args.method, problem, args.compression)
    plan.validate(w.num_layers)
    if not args.resume:
        options = RunOptions(
            iterations=args.iterations,
            lr=args.lr,
            seed=args.seed,
            dataset=args.dataset,
            data_dir=args.data_dir,
            emulate=args.emulate,
            dilation=args.dilation,
            timeout_s=args.timeout,
            save_model=bool(args.save),
            generation=args.generation,
            eval_every=args.eval_every,
            eval_samples=args.eval_samples,
            compression=None if args.plan else compression_text(*args.compression),  # a plan file: its own levels
        )
    else:
        options = replace(options, save_model=bool(args.save))
    if args.rank is not None:
        if faults or args.resume:
            raise UserError("--fail, --leave, --join, --slow and --resume need a local run (no --rank)")
        return _train_one_device(args, plan, w, options)
    run_dir = args.run_dir or time.strftime("runs/%Y%m%d-%H%M%S")
    writers = [save_events(args.events)] if args.events else []
    tty = sys.stderr.isatty() and not args.json
    if not args.json and not tty:
        writers.append(lambda ev: ev["type"] == "iteration" and print(iteration_line(ev, args.iterations), flush=True))
    if not args.json:
        writers.append(lambda ev: ev["type"] in CHANGE_LINES and print(change_line(ev), file=sys.stderr, flush=True))
        writers.append(lambda ev: ev["type"] == "eval" and print(eval_line(ev), file=sys.stderr, flush=True))
    result = train(
        plan, w, options, on_event=lambda ev: [f(ev) for f in writers], progress=tty, faults=faults,
        run_dir=run_dir, replicate_every=args.replicate_every, resume=resume, detect_s=args.detect,
    )  # fmt: skip
    if args.save:
        import torch

        try:
            torch.save(result.state_dict, args.save)
        except OSError as exc:
            raise UserError(f"cannot write model {args.save}: {exc}") from None
    if args.trace:
        from engine.simulator import simulate

        last = result.iterations[-1]
        begin = result.iterations[-2]["time"] if len(result.iterations) > 1 else 0.0
        if len(result.generations) > 1:  # the whole run: the lost device, the gap, the replayed iterations
            measured, title = list(result.events), f"measured: every iteration of {plan.method} {plan.model}"
        else:
            measured = [
                replace(e, start=e.start - begin, end=e.end - begin)
                for e in result.events
                if e.iteration == last["iteration"] and e.generation == last.get("generation", 0)
            ]
            title = f"measured: iteration {last['iteration'] + 1} of {plan.method} {plan.model}"
        names = plan.device_names
        sim = simulate(plan, w)
        trace = side_by_side(
            [
                chrome_trace(measured, names, title, 0),
                chrome_trace(list(sim.events), names, "simulated (cost model)", 1),
            ]
        )
        try:
            Path(args.trace).write_text(json.dumps(trace))
        except OSError as exc:
            raise UserError(f"cannot write trace {args.trace}: {exc}") from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(run_summary(result))
        for what, path in (("model", args.save), ("events", args.events), ("trace", args.trace)):
            if path:
                print(f"{what} written to {path}")
    return 0


def _train_one_device(args: argparse.Namespace, plan: Plan, w, options) -> int:
    """One device of a distributed run: this process is rank `--rank`; rank 0 hosts the store."""
    from dataclasses import replace

    from engine.costmodel import score
    from engine.runtime.config import DeviceConfig
    from engine.runtime.launcher import save_events
    from engine.runtime.worker import run_device
    from engine.steps import device_steps
    from engine.tables import iteration_line

    names = plan.device_names
    if not 0 <= args.rank < len(names):
        raise UserError(f"--rank must be between 0 and {len(names) - 1} for this plan, got {args.rank}")
    host, _, port = args.rendezvous.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--rendezvous must be HOST:PORT, got {args.rendezvous!r}")
    name = names[args.rank]
    steps, predicted = device_steps(plan, w)[name], score(plan, w).iteration_s
    # --save is the launcher's (it merges every stage's part); one device of a distributed run saves nothing
    options = replace(options, save_model=False)
    cfg = DeviceConfig(plan, steps, args.rank, host, int(port), options, args.rank == 0, predicted)
    write = save_events(args.events) if args.events else None
    errors: list[str] = []

    def emit(ev: dict) -> None:
        if write:
            write(ev)
        if ev["type"] == "iteration" and not args.json:
            print(iteration_line(ev, args.iterations), flush=True)
        elif ev["type"] == "device-error":
            errors.append(ev["message"])
        elif ev["type"] == "device-done" and args.json:
            print(json.dumps({k: v for k, v in ev.items() if k != "state_dict"}))

    if run_device(cfg, emit):
        raise UserError(f"device {name} stopped: {errors[0] if errors else 'unknown error'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine import bench

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
