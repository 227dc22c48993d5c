"""`train`: a local run of every device (emulated or not), a resumed run, or one device of a distributed run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine.cli.outputs import check_distinct, check_output, check_output_dir
from engine.cli.plan import _read_plan, fitting_plan
from engine.devices import Cluster, load_cluster
from engine.errors import UserError
from engine.plan import Plan
from engine.planners import PLANNERS, Problem


def _training_samples(args: argparse.Namespace) -> int | None:
    """The training set's size where `--compression delta:…` asks for it (what a pair keeps at most)."""
    if len(args.compression) < 3 or not args.compression[2]:
        return None
    from engine.data import train_size
    from engine.models import get_model

    return train_size(args.dataset, get_model(args.model), args.data_dir)


# What a plan file fixes, so a flag for it would be ignored: the flag and the plan's field that sets it
_PLAN_SETS = {
    "--batch-size": ("batch size", "batch_size"),
    "--method": ("method", "method"),
    "--bandwidth-mbps": ("bandwidth", "bandwidth_mbps"),
    "--compression": ("compression", "compression"),
    "--allreduce": ("all-reduce format", "allreduce"),
    "--schedule": ("schedule", "schedule"),
}
# What `--resume DIR` takes from the run in DIR (its run.json), so a flag for it would be ignored: the flag and
# where the run keeps its value (a RunOptions field or a run.json key; None: no value to compare with)
_RESUME_KEEPS = {
    "--batch-size": "batch_size", "--method": "method", "--bandwidth-mbps": None, "--compression": None,
    "--allreduce": "allreduce", "--iterations": "iterations", "--dataset": "dataset", "--data-dir": "data_dir",
    "--emulate": "emulate", "--dilation": "dilation", "--timeout": "timeout_s", "--generation": "generation",
    "--eval-samples": "eval_samples", "--replicate-every": "replicate_every", "--run-dir": None,
    "--init": "init", "--input-shape": None, "--seq-len": None,
}  # fmt: skip
# Run options a resumed run may change: where it computes (a run saved on a CPU goes on on a GPU, and back)
_RESUME_MAY_CHANGE = ("device",)


def _resume_keeps() -> dict[str, str | None]:
    """_RESUME_KEEPS and every run option a job's owner sets (--lr, --optimizer, --freeze, ...): a new option
    cannot escape the check."""
    from engine.runtime.options import settable

    flags = {"--" + name.replace("_", "-"): name for name in settable() if name not in _RESUME_MAY_CHANGE}
    return {**_RESUME_KEEPS, **flags}


def _given(args: argparse.Namespace, flags) -> list[str]:
    """The flags of `flags` given a value other than their default (so asked for)."""
    from engine.cli.parser import build_parser

    defaults = vars(build_parser().parse_args(["train"]))
    dest = {flag: flag[2:].replace("-", "_") for flag in flags}
    given = [flag for flag in flags if getattr(args, dest[flag], None) != defaults.get(dest[flag])]
    return [flag for flag in given if flag != "--compression" or any(args.compression)]  # "off": not asked


def _refuse_resume_overrides(args: argparse.Namespace, doc: dict) -> None:
    """UserError for a flag that `--resume` would ignore: the run goes on with its own settings (a value equal
    to the run's own is no mistake)."""
    kept, keeps = {**doc, **doc.get("options", {})}, _resume_keeps()
    for flag in _given(args, keeps):
        key = keeps[flag]
        if key is None or key not in kept or getattr(args, flag[2:].replace("-", "_")) != kept[key]:
            raise UserError(f"--resume continues the run in {args.resume} with its own settings: drop {flag}")


# What only a local run makes or uses: one device of a distributed run (--rank) would silently skip it
_LOCAL_ONLY = (
    "--save",
    "--trace",
    "--run-dir",
    "--replicate-every",
    "--resume",
    "--fail",
    "--leave",
    "--join",
    "--slow",
)


def _check_distributed(args: argparse.Namespace) -> None:
    """UserError for a flag one device of a distributed run would ignore, or a --rendezvous that is no
    HOST:PORT, before anything starts."""
    for flag in _LOCAL_ONLY:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, []):
            raise UserError(f"{flag} needs a local run (no --rank): one device of a distributed run does not do it")
    if args.rank < 0:
        raise UserError(f"--rank must be 0 or more, got {args.rank}")
    host, _, port = args.rendezvous.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--rendezvous must be HOST:PORT, got {args.rendezvous!r}")
    if not 1 <= int(port) <= 65535:
        raise UserError(f"--rendezvous: port must be 1-65535, got {port}")
    if not _loopback(host.strip("[]")) and not args.trust_lan:
        raise UserError(
            f"--rendezvous {args.rendezvous}: rank 0's store (torch's TCPStore) authenticates no one and is plaintext, "
            "so anyone who reaches that address could read and change the run; give a loopback address, or "
            "--trust-lan on a network only these hosts reach (the site's jobs are the protected way across boards)"
        )


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_dataset(args: argparse.Namespace, model: str, batch_size: int, plan: bool = False) -> None:
    """UserError unless the dataset holds one batch: said before planning and starting devices (each of which
    would find it out)."""
    from engine.data import train_size
    from engine.models import get_model

    samples = train_size(args.dataset, get_model(model), args.data_dir)
    if samples < batch_size:
        raise UserError(
            f"dataset {args.dataset!r} has {samples} samples, fewer than one batch of {batch_size}: "
            + ("plan a smaller batch" if plan else f"lower --batch-size to {samples} or less")
        )


def _resolve_recipe(args: argparse.Namespace, model: str) -> None:
    """Fill the recipe flags not given with the model family's defaults (engine.recipe.family_defaults), then
    check the options together (a warm-up past the run, a bad pattern), before any planning."""
    from engine.models import get_model
    from engine.recipe import RECIPE_OPTIONS, family_defaults
    from engine.runtime.options import RunOptions, settable

    brought = family_defaults(get_model(model), args.iterations)
    for name in RECIPE_OPTIONS:
        if getattr(args, name) is None:
            setattr(args, name, brought.get(name, settable()[name]["default"]))
    RunOptions(iterations=args.iterations, **{name: getattr(args, name) for name in settable()})


def _check_device(device: str) -> None:
    """UserError, before any planning, when this host cannot compute where the run asks (--device cuda without a
    GPU): every device process of a local run (or this one of --rank) runs here. (bf16 on a GPU without it is each
    device process's one line: asking the GPU would hold a CUDA context here, on a Jetson the board's memory.)"""
    from engine.runtime.placement import kind

    kind(device)


def is_weights_file(path: str) -> bool:
    """Whether `--save PATH` names a state_dict file (else, for a Hugging Face model, a model folder)."""
    from engine.models.weights import WEIGHT_SUFFIXES

    return Path(path).suffix in WEIGHT_SUFFIXES


def cmd_train(args: argparse.Namespace) -> int:
    from engine.compression import compression_text, parse_compression
    from engine.events import said
    from engine.recipe import planned
    from engine.runtime.launcher import RunOptions, save_events, train
    from engine.runtime.options import settable
    from engine.tables import iteration_line, run_summary
    from engine.trace import chrome_trace, side_by_side
    from engine.workloads import workload

    if (args.rank is None) != (args.rendezvous is None):
        raise UserError("a distributed run needs both --rank and --rendezvous")
    if args.rank is not None:
        _check_distributed(args)
    _check_device(args.device)
    outputs = (("--save", args.save), ("--events", args.events), ("--trace", args.trace))
    for option, path in outputs:
        if option == "--save" and path and (args.model or "").startswith("hf:") and not is_weights_file(path):
            check_output_dir(option, path)  # a Hugging Face model's folder
        else:
            check_output(option, path)
    check_distinct(outputs)
    check_output_dir("--run-dir", args.run_dir)
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
        _refuse_resume_overrides(args, doc)
        cluster = Cluster.from_dict(doc["cluster"])
        cluster = Cluster(
            tuple(d for d in cluster.devices if d.name in resume["devices"]),
            cluster.bandwidth_mbps, cluster.latency_ms, cluster.name,
        )  # fmt: skip
        w = planned(workload(doc["model"], cluster=cluster), RunOptions.from_dict(doc["options"]))
        method = doc["method"] if doc["method"] in PLANNERS else "asteroid"
        options = RunOptions.from_dict(doc["options"])
        allowed = parse_compression(options.compression or "off")
        problem = Problem(w, cluster, doc["batch_size"], allreduce=doc.get("allreduce", "off"),
                          schedule=options.schedule)  # fmt: skip
        plan = fitting_plan(method, problem, allowed)
        args.iterations, args.replicate_every = options.iterations, doc["replicate_every"]
        args.run_dir = args.resume
        if not args.json:
            print(f"resuming {doc['model']} in {args.resume} from iteration {resume['iteration']} "
                  f"on {len(plan.device_names)} devices", file=sys.stderr)  # fmt: skip
    elif args.plan:
        if args.model or args.cluster:
            raise UserError("give either --plan or --model/--cluster, not both")
        for flag in _given(args, _PLAN_SETS):
            what, field = _PLAN_SETS[flag]
            raise UserError(f"a plan file sets its own {what} (its {field!r} field): drop {flag}")
        plan = _read_plan(args.plan)
        _resolve_recipe(args, plan.model)
        _check_dataset(args, plan.model, plan.batch_size, plan=True)
        w = planned(workload(plan.model, cluster=plan.cluster), args)
    else:
        if not (args.model and args.cluster):
            raise UserError("train needs --model and --cluster (or --plan)")
        if args.rank is not None:
            raise UserError("a distributed run trains a plan file: pass --plan (every device the same)")
        cluster = load_cluster(args.cluster, args.bandwidth_mbps)
        _resolve_recipe(args, args.model)
        _check_dataset(args, args.model, args.batch_size)
        w = planned(workload(args.model, cluster=cluster), args)  # as the recipe trains it (engine.recipe)
        problem = Problem(w, cluster, args.batch_size, allreduce=args.allreduce, schedule=args.schedule)
        plan = fitting_plan(args.method, problem, args.compression, _training_samples(args))
    plan.validate(w.num_layers)
    if args.init:  # read and matched against the model now: a wrong file is one line before any device starts
        from engine.models import get_model
        from engine.models.weights import initial_layers

        args.init = str(Path(args.init).resolve())
        initial_layers(get_model(plan.model), 0, args.init)
    if not args.resume:
        options = RunOptions(
            iterations=args.iterations,
            **{name: getattr(args, name) for name in settable()},  # learning rate, seed, schedule, ...
            dataset=args.dataset,
            data_dir=args.data_dir,
            emulate=args.emulate,
            dilation=args.dilation,
            timeout_s=args.timeout,
            save_model=bool(args.save),
            generation=args.generation,
            eval_samples=args.eval_samples,
            init=args.init,
            compression=None if args.plan else compression_text(*args.compression),  # a plan file: its own levels
        )
    else:
        options = replace(options, save_model=bool(args.save), device=args.device)
    if args.rank is not None:
        return _train_one_device(args, plan, w, options)
    run_dir = args.run_dir or time.strftime("runs/%Y%m%d-%H%M%S")
    writers = [save_events(args.events)] if args.events else []
    tty = sys.stderr.isatty() and not args.json
    if not args.json and not tty:
        writers.append(lambda ev: ev["type"] == "iteration" and print(iteration_line(ev, args.iterations), flush=True))
    if not args.json:
        writers.append(lambda ev: (line := said(ev)) and print(line, file=sys.stderr, flush=True))
    result = train(
        plan, w, options, on_event=lambda ev: [f(ev) for f in writers], progress=tty, faults=faults,
        run_dir=run_dir, replicate_every=args.replicate_every, resume=resume, detect_s=args.detect,
    )  # fmt: skip
    if args.save:
        from engine.models import get_model
        from engine.models.weights import save_model

        save_model(get_model(plan.model), result.state_dict, args.save)
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
        from engine.recipe import describe

        summary = run_summary(result).split("\n")
        print("\n".join([*summary[:4], f"recipe       {describe(options)}", *summary[4:]]))
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
    host, _, port = args.rendezvous.rpartition(":")  # checked by _check_distributed
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
