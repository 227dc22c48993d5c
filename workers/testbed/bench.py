"""`python -m workers.testbed bench`: a lab on the testbed, measured: throughput against the prediction at two
link rates, detection and recovery of a pulled cable, a frozen board and a link flap, and a throttled board's
re-partition (results for docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from engine.errors import ErrorFirstParser
from webapp.embedded_redis import free_port
from workers.testbed.faults import Testbed
from workers.testbed.lab import Lab
from workers.testbed.net import TestbedError

DEVICES = [("nx-0", "jetson-xavier-nx", "b0"), ("tx2-0", "jetson-tx2", "b1"), ("nano-0", "jetson-nano", "b2")]
JOB = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 32, "iterations": 12}
NOTICED = re.compile(r"device (\S+) lost at iteration \d+ \((.*)\); noticed in ([0-9.]+) s")
RECOVERED = re.compile(r"recovered in ([0-9.]+) s real / ([0-9.]+) s device")


def measured(lab: Lab, job_id: int, generation: int | None = None) -> float:
    """Median measured throughput (samples/s, device time) of the job's iterations (of one generation)."""
    its = [e for e in lab.events(job_id, "iteration") if generation is None or e.get("generation") == generation]
    return statistics.median(e["throughput"] for e in its[1:] or its)  # the first iteration warms up


def rates(lab: Lab, out: list[str], results: dict) -> None:
    for rate, mbps in (("1gbit", 1000), ("200mbit", 200)):
        for board in lab.tb.boards[:3]:
            lab.tb.shape(board.name, rate)
        final, _ = lab.run_job({**JOB, "bandwidth_mbps": mbps})
        pred = final["plan"]["predicted"]  # the simulated iteration where the planner simulated it (it does)
        predicted = final["plan"]["batch_size"] / pred["simulated_s"] if pred.get("simulated_s") else pred["throughput"]
        got = measured(lab, final["id"])
        stages = [[d["name"] for d in st["devices"]] for st in final["plan"]["stages"]]
        results[f"rate {rate}"] = {"predicted": predicted, "measured": got, "stages": stages}
        out.append(f"| {rate} | {' / '.join(', '.join(s) for s in stages)} | {predicted:.0f} | {got:.0f} | "
                   f"{got / predicted:.2f} |")  # fmt: skip


def fault(lab: Lab, name: str, inflict, undo, out: list[str], results: dict, undo_after: float = 0.0) -> None:
    """One job with `inflict(board)` after iteration 2 (and `undo(board)` after `undo_after` s, or at the end)."""
    device = {}

    def during(job_id):
        plan = lab.api(f"/api/jobs/{job_id}/")["plan"]
        device["name"] = [d["name"] for st in plan["stages"] for d in st["devices"]][-1]
        board = lab.board_of[device["name"]]
        inflict(board)
        if undo_after:
            threading.Timer(undo_after, undo, (board,)).start()

    try:
        final, lines = lab.run_job(JOB, during)
    finally:
        if device and not undo_after:
            undo(lab.board_of[device["name"]])
    noticed = [m for line in lines if (m := NOTICED.search(line))]
    recovered = [m for line in lines if (m := RECOVERED.search(line))]
    reasons = [g["reason"] for g in final["generations"]]
    row = {
        "status": final["status"], "generations": reasons,
        "detected_s": float(noticed[0].group(3)) if noticed else None, "cause": noticed[0].group(2) if noticed else "",
        "recovered_real_s": float(recovered[0].group(1)) if recovered else None,
    }  # fmt: skip
    results[name] = row
    detected = f"{row['detected_s']:.1f} s ({row['cause']})" if noticed else "not evicted"
    recovery = f"{row['recovered_real_s']:.1f} s" if recovered else "-"
    out.append(f"| {name} | {device.get('name', '?')} | {detected} | {recovery} | {' → '.join(reasons)} | "
               f"{final['status']} |")  # fmt: skip


def throttled(lab: Lab, out: list[str], results: dict) -> None:
    """The NX held to 10 % of a core: before, after the re-partition, and the re-partition's own prediction."""

    def during(job_id):
        lab.tb.throttle(lab.board_of["nx-0"], 10)

    try:
        final, lines = lab.run_job({**JOB, "iterations": 16}, during)
    finally:
        lab.tb.unthrottle(lab.board_of["nx-0"])
    gens = final["generations"]
    said = next((line for line in lines if line.startswith("re-partitioned")), "no re-partition")
    its = [e for e in lab.events(final["id"], "iteration") if e.get("generation") == 0 and e["iteration"] >= 3]
    before = statistics.median(e["throughput"] for e in its) if its else float("nan")  # throttled, the first plan
    after = measured(lab, final["id"], len(gens) - 1) if len(gens) > 1 else float("nan")
    fresh = gens[-1]["predicted_throughput"] if len(gens) > 1 else float("nan")
    results["throttle"] = {"before": before, "after": after, "replanned_predicted": fresh, "said": said,
                           "generations": [g["reason"] for g in gens]}  # fmt: skip
    out.append(f"| {before:.0f} | {after:.0f} | {fresh:.0f} | {after / fresh:.2f} |")
    out.append("")
    out.append(f"The job's log: `{said}`")


def writable(name: str) -> Path:
    """FILE of --json, checked before anything is built (a bench takes many minutes): TestbedError when it could
    not be written at the end."""
    path = Path(name).expanduser()
    parent = path.parent.resolve()
    if path.is_dir():
        problem = "it is a directory"
    elif not parent.is_dir():
        problem = f"there is no directory {parent}"
    elif not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "permission denied"
    else:
        return path
    raise TestbedError(f"cannot write --json {name}: {problem}")


def main(argv: list[str] | None = None) -> int:
    """Run every measurement on a fresh testbed; print the tables (markdown) and, with --json FILE, the numbers."""
    p = ErrorFirstParser(
        prog="python -m workers.testbed bench",
        description="A lab on a testbed of its own, measured (docs/benchmarks.md).",
    )
    p.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = p.parse_args(argv)
    json_path = writable(args.json) if args.json else None
    out: list[str] = []
    results: dict = {}
    started = time.monotonic()
    tb = Testbed(name="abench", boards=len(DEVICES), subnet="198.18.45.0/24", rate=None)
    try:
        tb.up()  # on a failure or an interrupt (Ctrl-C, SIGTERM) in there, it removes what it made itself
        with tempfile.TemporaryDirectory() as var, Lab(tb, Path(var), free_port(), DEVICES,
                                                       ASTEROID_STORE_PORT=free_port()) as lab:  # fmt: skip
            out += ["### Measured against predicted throughput at two link rates (all three boards shaped)", "",
                    "| links | plan (stages) | predicted samples/s | measured | ratio |",
                    "|---|---|---|---|---|"]  # fmt: skip
            rates(lab, out, results)
            for board in tb.boards:
                tb.shape(board.name, None)
            out += ["", "### Faults from the world (after iteration 2; the plan's last device)", "",
                    "| fault | device | detected after | recovered in (real, detection included) | generations | job |",
                    "|---|---|---|---|---|---|"]  # fmt: skip
            fault(lab, "cable pulled", tb.unplug, tb.plug, out, results)
            fault(lab, "board frozen", tb.freeze, tb.thaw, out, results)
            fault(lab, "1.5 s link flap", lambda b: tb.flap(b, 1.5), lambda b: None, out, results)
            out += ["", "### A board throttled to 10 % of a core (nx-0, after iteration 2)", "",
                    "| throttled on the first plan, samples/s | after the re-partition | the re-partition's "
                    "prediction | ratio |",
                    "|---|---|---|---|"]  # fmt: skip
            throttled(lab, out, results)
    finally:
        tb.down()
    out += ["", f"({time.monotonic() - started:.0f} s in all)"]
    print("\n".join(out))
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(results, indent=1) + "\n")
        except OSError as exc:  # changed since the check: the tables above are printed all the same
            raise TestbedError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
    return 0
