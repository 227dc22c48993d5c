"""The benchmark's statistics and report: nearest-rank percentiles, the summary document, and its table."""

from __future__ import annotations

import math
import os
import platform

# The CLI's table layout (private in engine/tables.py; imported under the name this module always used).
from engine.tables import table
from workers.sitebench import GRACE_S, WINDOW_S


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of sorted `values` (None for none)."""
    if not values:
        return None
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


def latency_stats(values_s: list[float]) -> dict:
    ordered = sorted(values_s)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "count": len(ordered),
        "p50": ms(percentile(ordered, 50)),
        "p90": ms(percentile(ordered, 90)),
        "p99": ms(percentile(ordered, 99)),
        "max": ms(ordered[-1] if ordered else None),
    }


def summarize(args, sent: dict, records: list, agent, messages: dict, statuses: list, ended: list) -> dict:
    """The run's document: `sent` from the sender, `records` from the subscribers, `agent` a BenchAgent."""
    sent_at, t0 = sent["sent_at"], sent["t0"]
    events = len(sent_at)
    # from the first send to the end of the last batch's slot (the last batch is added batch/rate before it)
    duration = max(sent_at.values()) - t0 + args.batch / args.rate if sent_at else 0.0
    window = min(WINDOW_S, args.seconds / 2)
    all_s, first_s, last_s, per_subscriber = [], [], [], []
    by_second: dict[int, list[float]] = {}  # latencies by the second (since the first send) they were sent in
    for mine in records:
        lat = []
        for iteration, received in mine:
            at = sent_at.get(iteration)
            if at is None:
                continue
            delay = received - at
            lat.append(delay)
            offset = at - t0
            if offset < window:
                first_s.append(delay)
            if offset >= args.seconds - window:
                last_s.append(delay)
            by_second.setdefault(int(offset), []).append(delay)
        all_s.extend(lat)
        per_subscriber.append(latency_stats(lat)["p99"])
    stats = latency_stats(all_s)
    lateness = sorted(sent["lateness"])
    first, last = sent["seqs"]  # the outbox seqs of the iteration events
    ack = [s for seq, s in agent.outbox.ack_s if first <= seq <= last]
    known = [p for p in per_subscriber if p is not None]
    return {
        "config": {
            "url": args.url,
            "subscribers": args.subscribers,
            "rate": args.rate,
            "seconds": args.seconds,
            "batch": args.batch,
            "grace_s": GRACE_S,
            "window_s": window,
        },
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_1min": _load_average(),  # at the end: other work on the host skews every number
        },
        "sent": {
            "events": events,
            "messages": sum(1 for seq in agent.outbox.acks if first <= seq),  # `events` messages acknowledged
            "seconds": round(duration, 3),
            "rate": round(events / duration, 1) if duration > 0 else None,
            "late_p99_ms": round(percentile(lateness, 99) * 1000, 2) if lateness else None,
            "late_max_ms": round(lateness[-1] * 1000, 2) if lateness else None,
        },
        "ack_ms": latency_stats(ack),
        "agent_sessions": agent.sessions,
        "deliveries": stats["count"],
        "expected": events * args.subscribers,
        "lost": events * args.subscribers - stats["count"],
        "latency_ms": stats,
        "first_window": {"seconds": window, **latency_stats(first_s)},
        "last_window": {"seconds": window, **latency_stats(last_s)},
        "subscriber_p99_ms": {"min": min(known), "max": max(known)} if known else None,
        "p99_by_second_ms": [latency_stats(by_second.get(k, []))["p99"] for k in range(math.ceil(duration - 1e-6))],
        "messages": messages,
        "job_statuses": statuses,
        "subscribers_ended": ended,
        "site_errors": agent.warnings.lines[:20],
        "unexpected": agent.runner.unexpected[:20],
    }


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(result: dict) -> str:
    c, s, lat = result["config"], result["sent"], result["latency_ms"]
    w = c["window_s"]
    header = ["subscribers", "rate/s", "batch", "seconds", "deliveries", "lost", "p50 ms", "p90 ms", "p99 ms",
              "max ms", f"p99 first {w:g} s", f"p99 last {w:g} s"]  # fmt: skip
    row = [str(c["subscribers"]), f"{c['rate']:g}", str(c["batch"]), f"{c['seconds']:g}", str(result["deliveries"]),
           str(result["lost"]), _ms(lat["p50"]), _ms(lat["p90"]), _ms(lat["p99"]), _ms(lat["max"]),
           _ms(result["first_window"]["p99"]), _ms(result["last_window"]["p99"])]  # fmt: skip
    ack = result["ack_ms"]
    lines = [
        f"live event latency: job {result.get('job')}, device {result.get('device')}, {result.get('date', '')[:19]}Z, "
        f"{result['host']['cpus']} CPUs, load average {result['host']['load_average_1min']} at the end",
        f"added {s['events']} iteration events to the agent's outbox over {s['seconds']:.1f} s ({s['rate']} events/s; "
        f"behind schedule p99 {_ms(s['late_p99_ms'])} ms, max {_ms(s['late_max_ms'])} ms); its connection sent "
        f"them in {s['messages']} acknowledged messages",
        f"site's ack of an event, from its add to the outbox: p50 {_ms(ack['p50'])} ms, p99 {_ms(ack['p99'])} ms, "
        f"max {_ms(ack['max'])} ms",
        "",
        table(header, [row]),
        "",
    ]
    if result["subscriber_p99_ms"]:
        sp = result["subscriber_p99_ms"]
        lines.append(f"per-subscriber p99: {_ms(sp['min'])} to {_ms(sp['max'])} ms")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(result["messages"].items(), key=lambda kv: str(kv[0])))
    lines.append(f"messages received by the subscribers: {kinds or 'none'}")
    lines.append(f"job status at the end: {result.get('job_status_at_end')} (then cancelled)")
    if result["agent_sessions"] > 1:
        lines.append(f"warning: the agent's connection was lost and made again ({result['agent_sessions']} sessions)")
    for st in result["job_statuses"]:
        lines.append(f"warning: the job's status changed during the run: {st['status']}: {st['message']}")
    for line in result["subscribers_ended"][:5]:
        lines.append(f"warning: {line}")
    for message in result["site_errors"][:5]:
        lines.append(f"warning: the agent's connection: {message}")
    for message in result["unexpected"][:5]:
        lines.append(f"warning: the site sent the agent an unexpected {message}")
    return "\n".join(lines)
