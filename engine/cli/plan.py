"""`plan` and `simulate`: a plan for a model on a cluster, or a plan file's simulated iteration."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.cli.outputs import check_output
from engine.costmodel import ideal_throughput
from engine.devices import load_cluster
from engine.errors import UserError
from engine.plan import Plan
from engine.planners import COMPARED, NoFeasiblePlan, Problem
from engine.planners.feasibility import could_fit, diagnose
from engine.planners.levels import plan_compressed


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.models import get_model
    from engine.recipe import family_defaults, planned
    from engine.runtime.options import RunOptions
    from engine.tables import comparison_table, plan_table
    from engine.workloads import workload

    cluster = load_cluster(args.cluster, args.bandwidth_mbps)
    w = workload(args.model, refresh=args.refresh_profile, cluster=cluster)
    optimizer = args.optimizer or family_defaults(get_model(args.model), 1).get("optimizer", "sgd")
    recipe = RunOptions(optimizer=optimizer, freeze=args.freeze, lora=args.lora, lora_targets=args.lora_targets)
    w = planned(w, recipe)  # its optimizer state, its frozen part, its adapters
    problem = Problem(w, cluster, args.batch_size, allreduce=args.allreduce, schedule=args.schedule)
    if args.method != "all":
        plan = fitting_plan(args.method, problem, args.compression)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan_table(plan) + _left_out(plan, w))
        return 0
    if not could_fit(problem):
        raise UserError(infeasible_message(problem, "asteroid"))
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
        print(plan_table(results["asteroid"]) + _left_out(results["asteroid"], w))
    return 0


def _left_out(plan: Plan, w) -> str:
    """Lines saying why the plan leaves each unused device out (engine.planners.explain), or nothing."""
    from engine.planners.explain import left_out

    why = left_out(plan, w)
    return "".join(f"\nleft out: {name}: {reason}" for name, reason in why.items())


def fitting_plan(method: str, problem: Problem, compression: tuple = ((), False), samples: int | None = None) -> Plan:
    """The method's plan (at the `--compression` levels; `samples`: the training set's size, what activation
    changes keep at most), or a UserError saying what does not fit and which batch size would."""
    if not could_fit(problem):  # no plan can: said before planning, which takes minutes at a huge batch size
        raise UserError(infeasible_message(problem, method))
    try:
        plan = plan_compressed(method, problem, *compression, samples=samples, progress=sys.stderr.isatty())
    except NoFeasiblePlan:
        raise UserError(infeasible_message(problem, method)) from None
    if not plan.predicted.fits:
        raise UserError(infeasible_message(problem, method))
    return plan


def infeasible_message(problem: Problem, method: str) -> str:
    """Say what does not fit, and the largest batch size (halving) the method can offer instead."""
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

    check_output("--trace", args.trace)
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
