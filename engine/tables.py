"""Human-readable tables and progress lines for the CLI: plans, method comparisons, simulations, runs."""

from __future__ import annotations

from engine.devices import GIB, SHORT
from engine.events import Eval
from engine.plan import Plan
from engine.simulator import Simulation


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def shape(plan: Plan) -> str:
    """e.g. '3 stages: 1+2+3 devices'."""
    sizes = "+".join(str(len(st.devices)) for st in plan.stages)
    return f"{len(plan.stages)} stage{'s' * (len(plan.stages) != 1)}: {sizes} device{'s' * (sizes != '1')}"


def own_links(cluster) -> str:
    """ ", nano-2 on 20 Mbps" for the devices whose link is their own (empty when none is)."""
    return "".join(f", {d.name} on {d.link_mbps:g} Mbps" for d in cluster.devices if d.link_mbps is not None)


def plan_table(plan: Plan) -> str:
    """The stages, their layers and devices with shares and memory, and the prediction."""
    p = plan.predicted
    cluster = plan.cluster
    head = (
        f"{plan.method} plan for {plan.model} on cluster {cluster.name} "
        f"({len(cluster.devices)} devices, {cluster.bandwidth_mbps:g} Mbps{own_links(cluster)}): "
        f"batch {plan.batch_size} = "
        f"{plan.micro_batches} micro-batch{'es' * (plan.micro_batches != 1)} of {plan.micro_batch_size}"
    )
    rows = []
    for k, st in enumerate(plan.stages):
        for n, share in enumerate(st.devices):
            dev = cluster.device(share.name)
            used = p.memory_bytes[share.name] if p else 0
            mark = "" if used <= dev.memory_bytes else "  OVER"
            rows.append(
                [
                    str(k) if n == 0 else "",
                    f"[{st.start}, {st.end})" if n == 0 else "",
                    share.name,
                    SHORT.get(dev.kind, dev.kind),
                    str(share.samples),
                    f"{gib(used)} / {gib(dev.memory_bytes)}{mark}",
                ]
            )
    idle = [d.name for d in cluster.devices if d.name not in set(plan.device_names)]
    out = [head, "", table(["stage", "layers", "device", "kind", "samples", "memory GiB used / avail"], rows)]
    if idle:
        out.append(f"idle (not worth their communication): {', '.join(idle)}")
    if plan.compressed:
        levels = ", ".join(f"{k}->{k + 1} {'off' if b >= 32 else f'{b}-bit'}" for k, b in enumerate(plan.compression))
        out.append(f"compression between stages: {levels}")
        if plan.delta:
            out.append(
                f"  samples seen before send the change of their activation; each pair keeps up to "
                f"{plan.delta_samples} samples"
            )
    if plan.allreduce != "off":
        out.append(f"stage all-reduce: {plan.allreduce} (half the bytes of float32)")
    if plan.schedule != "1f1b":
        out.append(f"schedule: {plan.schedule} (backward split into input and weight gradients, engine/schedule.py)")
    if p:
        out += [
            "",
            f"predicted: {p.expected_throughput:.1f} samples/s, iteration {p.expected_s:.3f} s"
            + (
                f" (simulated; the 1F1B closed form says {p.iteration_s:.3f} s with a "
                f"{100 * p.bubble_fraction:.1f}% bubble)"
                if p.simulated_s is not None
                else f", bubble {100 * p.bubble_fraction:.1f}%"
            )
            + f", {'fits in memory' if p.fits else 'DOES NOT FIT in memory'}",
        ]
    return "\n".join(out)


def comparison_table(results: dict[str, Plan | str], ideal: float) -> str:
    """One row per method: shape, micro-batches, iteration, throughput, Asteroid's speedup over it."""
    ours = results.get("asteroid")
    base = ours.predicted.expected_throughput if isinstance(ours, Plan) else None
    rows = []
    for method, r in results.items():
        if isinstance(r, str):
            rows.append([method, r, "", "", "", "", ""])
            continue
        p = r.predicted
        speedup = f"{base / p.expected_throughput:.2f}x" if base and p.fits else ""
        rows.append(
            [
                method,
                shape(r),
                str(r.micro_batches),
                f"{p.expected_s:.3f}",
                f"{p.expected_throughput:.1f}" + ("" if p.fits else " (does not fit)"),
                f"{100 * p.expected_throughput / ideal:.0f}%",
                speedup,
            ]
        )
    header = ["method", "plan", "micro-batches", "iteration s", "samples/s", "of ideal", "asteroid speedup"]
    return table(header, rows) + f"\nideal (every device alone, no communication): {ideal:.1f} samples/s"


def simulation_table(plan: Plan, sim: Simulation) -> str:
    """Per device: busy time by kind, and the share of the iteration it neither computes nor all-reduces (its
    sends go out on its link meanwhile); then the totals."""
    busy: dict[str, dict[str, float]] = {}
    for e in sim.events:
        busy.setdefault(e.device, {}).setdefault(e.kind, 0.0)
        busy[e.device][e.kind] += e.end - e.start
    rows = []
    for k, st in enumerate(plan.stages):
        for share in st.devices:
            b = busy.get(share.name, {})
            total = sum(b.get(kind, 0.0) for kind in ("F", "B", "W", "all-reduce"))  # sends overlap compute
            rows.append(
                [
                    str(k),
                    share.name,
                    f"{b.get('F', 0):.3f}",
                    f"{b.get('B', 0):.3f}",
                    f"{b.get('W', 0):.3f}",
                    f"{b.get('send', 0):.3f}",
                    f"{b.get('all-reduce', 0):.3f}",
                    f"{100 * (1 - total / sim.iteration_s):.0f}%",
                    f"{gib(sim.memory_bytes[share.name])} / {gib(plan.cluster.device(share.name).memory_bytes)}",
                ]
            )
    header = ["stage", "device", "F s", "B s", "W s", "send s", "all-reduce s", "idle", "memory GiB"]
    return "\n".join(
        [
            f"simulated {plan.schedule.upper()} iteration of the {plan.method} plan for {plan.model} "
            f"({plan.micro_batches} micro-batches of {plan.micro_batch_size})",
            "",
            table(header, rows),
            "",
            f"simulated: iteration {sim.iteration_s:.3f} s, {sim.throughput:.1f} samples/s, "
            f"bubble {100 * sim.bubble_fraction:.1f}%; cost model closed form {sim.predicted_iteration_s:.3f} s; "
            f"{'fits in memory' if sim.fits else 'DOES NOT FIT in memory'}",
        ]
    )


def iteration_line(ev: dict, total: int) -> str:
    """One line per trained iteration."""
    loss = "diverged" if ev["loss"] is None else f"{ev['loss']:.4f}"
    skipped = f"  step skipped (fp16 overflow; loss scale now {ev['loss_scale']:g})" if ev.get("skipped") else ""
    return (
        f"iteration {ev['iteration'] + 1}/{total}  loss {loss}  "
        f"{ev['throughput']:.1f} samples/s  ({ev['iteration_s'] * 1000:.1f} ms, device time){skipped}"
    )


def run_summary(result) -> str:
    """Measured against predicted, per-device memory and late steps of a finished run (a RunResult)."""
    plan = result.plan
    measured, simulated = result.measured_iteration_s, result.simulated_iteration_s
    lines = [
        f"{plan.method} plan for {plan.model}, batch {plan.batch_size}, {shape(plan)}",
        f"throughput   measured {result.throughput:.1f} samples/s, predicted {plan.batch_size / simulated:.1f} "
        f"({measured / simulated:.3f}x the simulated iteration time)",
        f"iteration    measured {measured * 1000:.2f} ms, simulated {simulated * 1000:.2f} ms, cost model's closed "
        f"form {result.predicted_iteration_s * 1000:.2f} ms (device time)",
        f"loss         {result.loss[0]:.4f} -> {result.loss[-1]:.4f} over {len(result.loss)} iteration(s)",
    ]
    if result.dilation is not None:
        lines.append(
            f"emulation    dilation {result.dilation:.1f} (wall seconds per device second), "
            f"{result.late_steps} late of {result.steps} steps, {result.wall_s:.1f} s wall"
        )
    if getattr(result, "payload_bytes", 0):
        wire, raw = result.wire_bytes, result.payload_bytes
        levels = ", ".join("off" if b >= 32 else f"{b}-bit" for b in plan.compression) if plan.compressed else "off"
        lines.append(
            f"links        {wire / 1e6:.1f} MB of activations and gradients sent between stages "
            f"(compression {levels}; {raw / 1e6:.1f} MB uncompressed, {raw / max(wire, 1):.1f}x fewer bytes)"
        )
    evals = getattr(result, "evals", [])
    if evals:
        first, last = evals[0], evals[-1]
        scores = [Eval.from_message(ev).score() for ev in (first, last)]
        lines.append(
            f"held-out     after iteration {first['iteration'] + 1}: {scores[0]}; after iteration "
            f"{last['iteration'] + 1}: {scores[1]} ({last['samples']} samples)"
        )
    K = getattr(result, "replicate_every", 0)
    if K:
        cost = result.replication_s / (K * result.predicted_iteration_s)
        lines.append(
            f"replication  every {K} iteration(s), {result.replication_s:.3f} s device per replication point, "
            f"{cost:.1%} of the throughput (predicted)"
        )
    elif hasattr(result, "replicate_every"):
        lines.append(
            "replication  off: a lost layer no live peer holds is rebuilt from the seed and every iteration replayed"
        )
    for rec in getattr(result, "recoveries", []):
        lines.append(f"recovery     {rec['summary']}")
    rows = []
    names = plan.device_names if len(getattr(result, "generations", [])) < 2 else list(result.devices)
    for name in names:
        d = result.devices.get(name, {})
        cap = (getattr(result, "cluster", None) or plan.cluster).device(name).memory_bytes
        rows.append([name, gib(d.get("peak_memory_bytes", 0)), gib(cap), str(d.get("late_steps", 0))])
    lines += ["", table(["device", "peak memory", "budget", "late steps"], rows)]
    if result.steps and result.late_steps > 0.05 * result.steps:
        lines.append(
            f"warning: {result.late_steps} of {result.steps} steps ran late: the host could not keep up; "
            f"repeat with a larger --dilation (e.g. {2 * (result.dilation or 1):.0f}) for an honest emulation"
        )
    return "\n".join(lines)
