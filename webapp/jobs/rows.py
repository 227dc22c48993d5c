"""Table rows of the plan page (one per device of the plan, one per planning method), and the labels they show."""

from __future__ import annotations

from collections.abc import Mapping

from engine.devices import GIB, KINDS
from engine.plan import Plan, Prediction

KIND_LABELS = {**{k: v.label for k, v in KINDS.items()}, "custom": "Custom device"}
METHOD_LABELS = {
    "asteroid": "Asteroid",
    "dp": "DP (data parallel)",
    "gpipe": "GPipe",
    "pipedream": "PipeDream",
    "ftpipehd": "FTPipeHD",
    "exhaustive": "Exhaustive search",
}
METHOD_ORDER = ("asteroid", "dp", "gpipe", "pipedream", "ftpipehd")


def device_rows(plan: Plan) -> list[dict]:
    """One row per device of the plan, in plan order: where it sits, its share and its predicted memory."""
    devices = {d.name: d for d in plan.cluster.devices}
    memory = plan.predicted.memory_bytes if plan.predicted else {}
    rows = []
    for k, st in enumerate(plan.stages):
        for share in st.devices:
            device = devices.get(share.name)
            kind = device.kind if device else "custom"
            capacity = device.memory_bytes if device else None
            used = memory.get(share.name)
            rows.append(
                {
                    "device": share.name,
                    "kind": kind,
                    "kind_label": KIND_LABELS.get(kind, kind),
                    "stage": k,
                    "layers": f"[{st.start}, {st.end})",
                    "start": st.start,
                    "end": st.end,
                    "samples": share.samples,
                    "micro_batch_size": plan.micro_batch_size,
                    "memory_gib": None if used is None else round(used / GIB, 3),
                    "capacity_gib": None if capacity is None else round(capacity / GIB, 2),
                    "fits": None if used is None or capacity is None else used <= capacity,
                }
            )
    return rows


def unused_devices(plan: Plan) -> list[str]:
    """Devices of the plan's cluster that no stage uses."""
    used = set(plan.device_names)
    return [d.name for d in plan.cluster.devices if d.name not in used]


def predictions(comparison: Mapping[str, Plan | str]) -> dict[str, Prediction | str]:
    """Each method's prediction, or why it has none ("" for a plan stored without one)."""
    return {m: p if isinstance(p, str) else p.predicted or "" for m, p in comparison.items()}


def _methods(comparison: Mapping[str, object]) -> list[str]:
    known = [m for m in METHOD_ORDER if m in comparison]
    return known + sorted(m for m in comparison if m not in METHOD_ORDER)


def _throughput(outcome: Prediction | str | None) -> float | None:
    if not isinstance(outcome, Prediction):
        return None
    return outcome.expected_throughput if outcome.throughput > 0 else None


def comparison_rows(comparison: Mapping[str, Prediction | str]) -> list[dict]:
    """One row per method: predicted throughput and iteration time, Asteroid's speedup over it, or why it has no plan.

    `comparison` maps each method to its plan's prediction or to why it has none (see `predictions`). `error` is
    the reason alone (a leading "no plan: " is dropped), so a page can write "no plan: {error}".
    """
    ours = _throughput(comparison.get("asteroid"))
    rows = []
    for method in _methods(comparison):
        outcome = comparison[method]
        tp = _throughput(outcome)
        error = None
        if tp is None:
            reason = outcome if isinstance(outcome, str) else ""
            error = reason.removeprefix("no plan: ").strip() or "no plan found"
        rows.append(
            {
                "method": method,
                "label": METHOD_LABELS.get(method, method),
                "throughput": None if tp is None else round(tp, 1),
                "iteration_s": None if tp is None else round(outcome.expected_s, 4),
                "fits": None if tp is None else outcome.fits,
                "speedup": None if tp is None or ours is None else round(ours / tp, 2),
                "error": error,
            }
        )
    return rows
