"""`control`'s figures from what was sent, received and stored, and its report."""

from __future__ import annotations

import os
import platform

from engine.tables import table
from workers.sitebench.stats import latency_stats


def _window(kills: list[dict], t0: float) -> tuple[float, float] | None:
    """From the first kill to 30 s after the last: the part of the run the kills disturb."""
    if not kills:
        return None
    return kills[0]["t"], kills[-1]["t"] + 30.0


def summarize_control(args, senders, agents, urls, job_ids, seen_iterations, seen_steps, reconnects, stored, after,
                      compacted, cpu, lags, kills, t0, elapsed) -> dict:  # fmt: skip
    """The run's document."""
    by_job = {s.job: s for s in senders}
    window = _window(kills, t0)

    def calm(at: float) -> bool:
        return window is None or not window[0] <= at <= window[1]

    iteration_s, step_s, disturbed_s = [], [], []
    lost_browser = missed_steps = sent_steps_watched = 0
    gaps = []
    for i, url in enumerate(urls):
        sender = by_job[int(url.rstrip("/").rsplit("/", 1)[1])]
        got = seen_iterations[i]
        arrivals = []
        for k, at in sender.sent_iterations.items():
            if k not in got:
                lost_browser += 1
                continue
            when, live = got[k]
            if live:
                (iteration_s if calm(at) else disturbed_s).append(when - at)
                arrivals.append(when)
        arrivals.sort()
        gaps.append(max((b - a for a, b in zip(arrivals, arrivals[1:], strict=False)), default=0.0))
        steps = {(d, k, mb, kind): when for d, k, mb, kind, when in seen_steps[i]}
        sent_steps_watched += len(sender.sent_steps)
        for key, at in sender.sent_steps.items():
            when = steps.get(key)
            if when is None:
                missed_steps += 1
            elif calm(at):
                step_s.append(when - at)
    sent_iterations = sum(len(s.sent_iterations) for s in senders)
    sent_steps = sum(len(s.sent_steps) for s in senders)
    stored_iterations = sum(len(stored["iterations"][s.job] & set(s.sent_iterations)) for s in senders)
    stored_steps = sum(stored["steps"].values())
    heartbeat_s = [v for a in agents for v in a.connection.heartbeat_s]
    ack_s = [v for a in agents for _, v in a.outbox.ack_s]
    job_hours = len(job_ids) * elapsed / 3600

    def per_job_hour(doc: dict) -> dict:
        return {kind: {"rows": round(v["rows"] / job_hours), "bytes": round(v["bytes"] / job_hours)}
                for kind, v in sorted(doc["by_kind"].items())}  # fmt: skip

    restarted = [
        (at - kills[0]["t"]) for s in senders for at, gen in s.generations if kills and gen > 0
    ]  # fmt: skip
    taken = [at - k["t"] for k in kills for at in (k.get("taken_over") or {}).values()]
    held, again = _starts_at_boards(senders, kills)
    event_p99 = [d["event_ms"].get("p99_ms") for smp in lags for d in smp.get("by_process", {}).values()]
    event_p50 = [d["event_ms"].get("p50_ms") for smp in lags for d in smp.get("by_process", {}).values()]
    loop_p99 = [d["loop_ms"].get("p99_ms") for smp in lags for d in smp.get("by_process", {}).values()]
    clean = lambda xs: sorted(x for x in xs if x is not None)  # noqa: E731
    return {
        "setup": {
            "agents": args.agents,
            "jobs": len(job_ids),
            "boards_per_job": args.job_devices,
            "browsers": len(urls),
            "seconds": round(elapsed, 1),
            "daphnes": args.daphnes,
            "coordinators": args.coordinators,
            "celery_workers": args.celery,
            "events_per_s": round((sent_iterations + sent_steps) / elapsed, 1),
            "iteration_s": sorted({round(s.every, 3) for s in senders}),
            "host": f"{platform.node()} ({os.cpu_count()} cores)",
        },  # fmt: skip
        "latency_ms": {
            "iteration": latency_stats(iteration_s),
            "step": latency_stats(step_s),
            "iteration_after_kill": latency_stats(disturbed_s),
        },  # fmt: skip
        "heartbeat_ms": latency_stats(heartbeat_s),
        "ack_ms": latency_stats(ack_s),
        "coordinators": {
            "event_age_p50_ms": _median(clean(event_p50)),
            "event_age_p99_ms_worst": max(clean(event_p99), default=None),
            "loop_lag_p99_ms_worst": max(clean(loop_p99), default=None),
            "samples": len(lags),
        },  # fmt: skip
        "lost": {
            "iterations_not_stored": sent_iterations - stored_iterations,
            "steps_not_stored": sent_steps - stored_steps,
            "iterations_never_shown": lost_browser,
            "steps_not_shown_live": missed_steps,
            "steps_watched": sent_steps_watched,
            "browser_reconnects": sum(reconnects),
            "agent_reconnects": sum(max(0, a.sessions - 1) for a in agents),
        },  # fmt: skip
        "kills": [{"role": k["role"], "at_s": round(k["t"] - t0, 1)} for k in kills],
        "leases_taken_over": len(taken),
        "lease_taken_over_s": latency_stats(taken),
        "jobs_restarted": len(restarted),
        "restart_s": latency_stats(restarted),
        "start_at_boards_reconnected_s": latency_stats([t for t, _ in again]),
        "start_after_hello_s": latency_stats([d for _, d in again]),
        "start_at_boards_connected_s": latency_stats(held),
        "longest_live_gap_s": {"p50": round(_median(sorted(gaps)) or 0.0, 2), "max": round(max(gaps, default=0.0), 2)},
        "storage_per_job_hour": per_job_hour(stored),
        "storage_per_job_hour_after_compaction": per_job_hour(after),
        "compaction": compacted,
        "cpu_cores": cpu,
    }


def _starts_at_boards(senders, kills: list[dict]) -> tuple[list[float], list[tuple[float, float]]]:
    """The boards of the jobs started again after the kills: for those whose session held, when the new start
    reached each (s after the first kill); for those that connected again (their daphne died), that and how long
    after their hello."""
    held, again = [], []
    for sender in senders:
        for agent in sender.agents:
            new = [at for at, msg in agent.runner.starts if kills and msg.get("generation", 0) > 0]
            if not new:
                continue
            hello = next((h for h in agent.hellos if h > kills[0]["t"]), None)
            if hello is None:
                held.append(new[0] - kills[0]["t"])
            else:
                again.append((new[0] - kills[0]["t"], new[0] - hello))
    return held, again


def _boards_line(doc: dict) -> str:
    """When the new start reached the boards that kept their session and those that made it again."""
    kept, again, after = (doc.get(k) or {} for k in ("start_at_boards_connected_s", "start_at_boards_reconnected_s",
                                                      "start_after_hello_s"))  # fmt: skip
    return (
        f"the new start reached {kept.get('count', 0)} boards whose session held after {kept.get('p50')} ms "
        f"(p50), {kept.get('max')} ms (max); {again.get('count', 0)} boards that connected again after "
        f"{again.get('p50')} ms (p50), {again.get('max')} ms (max), {after.get('p50')} ms (p50) after their hello"
    )


def _median(values: list[float]) -> float | None:
    return values[len(values) // 2] if values else None


def render_control(doc: dict) -> str:
    s, lat = doc["setup"], doc["latency_ms"]
    lines = [
        f"{s['agents']} boards, {s['jobs']} jobs of {s['boards_per_job']} boards, {s['browsers']} browser sockets, "
        f"{s['seconds']} s, {s['events_per_s']} events/s; {s['daphnes']} daphne, {s['coordinators']} coordinators, "
        f"{s['celery_workers']} Celery; {doc.get('database')}, Redis {doc.get('redis')}; iterations of "
        f"{', '.join(map(str, s['iteration_s']))} s",
        "",
    ]
    rows = [[name, v["count"], v["p50"], v["p90"], v["p99"], v["max"]] for name, v in (
        ("agent -> browser: iteration", lat["iteration"]), ("agent -> browser: step", lat["step"]),
        ("  ... in the 30 s after a kill", lat["iteration_after_kill"]),
        ("heartbeat handled", doc["heartbeat_ms"]), ("agent's batch acknowledged", doc["ack_ms"]))]  # fmt: skip
    lines += table(["latency (ms)", "count", "p50", "p90", "p99", "max"], rows).splitlines()
    c = doc["coordinators"]
    lines += ["", f"coordinators: device event read {c['event_age_p50_ms']} ms after it was stored (median p50), "
                  f"worst p99 {c['event_age_p99_ms_worst']} ms; watch loop late by at most {c['loop_lag_p99_ms_worst']}"
                  f" ms (p99); {c['samples']} samples"]  # fmt: skip
    lost, drain = doc["lost"], doc.get("drain", {})
    lines += [f"after streaming, the site took {drain.get('seconds')} s to store what the boards held; "
              f"{drain.get('events_still_held')} events still held then, "
              f"{drain.get('steps_dropped_by_full_outboxes')} steps dropped by full outboxes"]  # fmt: skip
    if doc.get("jobs_at_end"):
        ended = ", ".join(f"{n} {status}" for status, n in sorted(doc["jobs_at_end"].items()))
        why = "; ".join(doc.get("why_jobs_ended") or [])
        lines += [f"jobs when streaming ended: {ended}" + (f" ({why})" if why else "") +
                  " (a job that ended drops what its boards still send)"]  # fmt: skip
    lines += [f"lost: {lost['iterations_not_stored']} iterations and {lost['steps_not_stored']} steps not stored; "
              f"{lost['iterations_never_shown']} iterations never shown; {lost['steps_not_shown_live']} of "
              f"{lost['steps_watched']} steps not shown live; {lost['browser_reconnects']} browser and "
              f"{lost['agent_reconnects']} agent reconnects"]  # fmt: skip
    if doc["kills"]:
        r = doc["restart_s"]
        killed = ", ".join(f"{k['role']} at {k['at_s']} s" for k in doc["kills"])
        gap = doc["longest_live_gap_s"]["max"]
        t = doc.get("lease_taken_over_s") or {}
        lines += [f"killed: {killed}; another coordinators process took over {doc.get('leases_taken_over', 0)} "
                  f"of its jobs' leases after {t.get('p50')} ms (p50), {t.get('max')} ms (max); "
                  f"{doc['jobs_restarted']} jobs' new start reached every board after {r['p50']} ms (p50), "
                  f"{r['max']} ms (max)",
                  _boards_line(doc),
                  f"longest gap in a browser's iterations: {gap} s"]  # fmt: skip
    for title, key in (("stored per job-hour", "storage_per_job_hour"),
                       ("kept per job-hour after compaction", "storage_per_job_hour_after_compaction")):  # fmt: skip
        parts = [f"{k}: {v['rows']} rows, {v['bytes'] / 1e6:.1f} MB" for k, v in doc[key].items()]
        lines.append(f"{title}: {'; '.join(parts)}")
    lines.append("CPU (cores): " + ", ".join(f"{k} {v}" for k, v in doc["cpu_cores"].items()))
    return "\n".join(lines)
