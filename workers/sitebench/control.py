"""The `control` run: a site of its own, N boards heartbeating, M jobs streaming, B browsers watching; then a
coordinators process and a daphne process killed mid-run; what it cost, what was lost, what was kept."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import psutil

from workers.sitebench import GRACE_S, MODEL, PLAN_TIMEOUT_S, START_TIMEOUT_S, BenchError
from workers.sitebench.api import Api, create_token, enrollment, socket_url, wait_for_status
from workers.sitebench.fleet import FleetAgent, JobSender
from workers.sitebench.sut import SiteUnderTest
from workers.sitebench.tally import summarize_control
from workers.sitebench.watchers import Watchers

ITERATIONS = 100_000
LAG_EVERY_S = 5.0


def say(args, text: str) -> None:
    if not args.quiet:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _django(sut: SiteUnderTest) -> None:
    """This process reads the site's database and Redis (stored events, the coordinators' lag) as the site does."""
    os.environ.update(sut.env, REDIS_URL=sut.redis_url, DJANGO_SETTINGS_MODULE="webapp.settings")
    import django

    django.setup()


def _credentials(api: Api, site, names: list[str]) -> list[str]:
    from workers.enroll import enroll

    def one(name: str) -> str:
        status, reply = api.call("POST", "/api/devices/", {"name": name, "kind": "jetson-xavier-nx"}, ok=(400, 409))
        token = reply.get("enrollment_token") if status < 300 else enrollment(api, name)[1]
        return enroll(site, token, 3).credential

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, names))


async def _sample_lag(samples: list[dict], stop: asyncio.Event) -> None:
    from webapp.jobs import lag

    while not stop.is_set():
        try:
            samples.append({"t": time.monotonic(), "by_process": await asyncio.to_thread(lag.read)})
        except Exception as exc:  # noqa: BLE001 - Redis briefly unreachable: a gap in the samples, said
            samples.append({"t": time.monotonic(), "error": str(exc)})
        try:
            await asyncio.wait_for(stop.wait(), LAG_EVERY_S)
        except TimeoutError:
            pass


async def _kill(args, sut: SiteUnderTest, at: float, kills: list[dict]) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    owners = await asyncio.to_thread(_lease_owners)  # read before the kill: another process claims within 0.5 s
    for name in ("coordinators", "daphne") if args.kill == "both" else (args.kill,):
        pid = await asyncio.to_thread(sut.kill, name)
        kill = {"role": name, "pid": pid, "t": time.monotonic()}
        kills.append(kill)
        say(args, f"killed the {name} process {pid} (SIGKILL)")
        if name == "coordinators":
            held = {pk: owner for pk, owner in owners.items() if owner.split(":")[1:2] == [str(pid)]}
            kill["taken_over"] = asyncio.create_task(_taken_over(held))


def _lease_owners() -> dict[int, str]:
    """Every job's coordinators process ("host:pid:nonce", leases.this_process), by job id."""
    from webapp.jobs.models import Job

    return dict(Job.objects.values_list("pk", "coordinator"))


async def _taken_over(held: dict[int, str], limit_s: float = 60.0) -> dict[int, float]:
    """Per job of `held` (its lease's owner when the process was killed): when another process's lease on it
    replaced that one (monotonic time; read every 0.1 s, for up to `limit_s`)."""
    from webapp.jobs.models import Job

    taken: dict[int, float] = {}
    deadline = time.monotonic() + limit_s
    while len(taken) < len(held) and time.monotonic() < deadline:
        rows = await asyncio.to_thread(lambda: list(Job.objects.filter(pk__in=held).values_list("pk", "coordinator")))
        now = time.monotonic()
        for pk, owner in rows:
            if owner and owner != held[pk] and pk not in taken:
                taken[pk] = now
        await asyncio.sleep(0.1)
    return taken


def _stored(job_ids: list[int]) -> dict:
    """Per job: the distinct iterations and the step rows the database has; rows and bytes by kind of event."""
    from django.db import connection
    from django.db.models import Count

    from webapp.jobs.models import JobEvent

    size = "pg_column_size(data)" if connection.vendor == "postgresql" else "length(data)"
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT CASE WHEN type = 'step' THEN 'step' ELSE 'other' END, COUNT(*), COALESCE(SUM({size}), 0) "
            f"FROM jobs_jobevent WHERE job_id IN ({','.join(map(str, job_ids))}) GROUP BY 1"
        )
        by_kind = {kind: {"rows": rows, "bytes": int(size_)} for kind, rows, size_ in cur.fetchall()}
    rows = JobEvent.objects.filter(job_id__in=job_ids, type="iteration").values_list("job_id", "data")
    iterations: dict[int, set[int]] = {j: set() for j in job_ids}
    for job_id, data in rows:
        iterations[job_id].add(data["iteration"])
    steps = dict(JobEvent.objects.filter(job_id__in=job_ids, type="step").values_list("job_id").annotate(Count("id")))
    return {"by_kind": by_kind, "iterations": iterations, "steps": steps}


def _compact(job_ids: list[int]) -> dict:
    from webapp.jobs.models import Job
    from webapp.jobs.retention import compact

    return {"rows_deleted": sum(compact(job) for job in Job.objects.filter(pk__in=job_ids))}


async def run_control(args) -> dict:
    started = datetime.now(UTC)
    sut = SiteUnderTest(args.daphnes, args.coordinators, args.celery, args.database_url, args.redis_url)
    say(args, f"starting the site under test ({args.daphnes} daphne, {args.coordinators} coordinators, "
              f"{args.celery} Celery; {sut.var})")  # fmt: skip
    await asyncio.to_thread(sut.start)
    agents: list[FleetAgent] = []
    watchers: Watchers | None = None
    job_ids: list[int] = []
    api = None
    try:
        _django(sut)
        from workers.site import Site

        token = await asyncio.to_thread(create_token, "admin", sut.env)
        api, site = Api(sut.url, token), Site.parse(sut.url)
        say(args, f"enrolling {args.agents} boards")
        names = [f"bench-{i:03d}" for i in range(args.agents)]
        credentials = await asyncio.to_thread(_credentials, api, site, names)
        agents = [FleetAgent(site, c) for c in credentials]
        for k in range(0, len(agents), 50):  # connect in waves, as a lab's boards come up
            await asyncio.gather(*(a.start() for a in agents[k : k + 50]))
        say(args, f"{len(agents)} agents connected; creating {args.jobs} jobs of {args.job_devices} boards")
        groups = [agents[i * args.job_devices : (i + 1) * args.job_devices] for i in range(args.jobs)]
        for group in groups:
            job = await asyncio.to_thread(api.post, "/api/jobs/", {
                "model": MODEL, "dataset": "synthetic", "batch_size": args.batch_size, "iterations": ITERATIONS,
                "devices": [a.name for a in group]})  # fmt: skip
            job_ids.append(job["id"])
            for a in group:
                a.runner.expected = job["id"]
        await asyncio.gather(*(wait_for_status(api, j, "planned", PLAN_TIMEOUT_S * 2) for j in job_ids))
        for j in job_ids:
            await asyncio.to_thread(api.post, f"/api/jobs/{j}/launch/")
        for a in agents[: args.jobs * args.job_devices]:
            if not await a.until(a.runner.started, START_TIMEOUT_S * 2):
                raise BenchError(f"device {a.name} got no start within {START_TIMEOUT_S * 2:.0f} s")
        urls = [socket_url(sut.url, f"/ws/jobs/{job_ids[i % len(job_ids)]}/") for i in range(args.browsers)]
        say(args, f"jobs running; connecting {args.browsers} browser sockets")
        watchers = Watchers(urls, token)
        await watchers.ready()
        senders = [JobSender(j, g) for j, g in zip(job_ids, groups, strict=True)]
        me, browsers = psutil.Process(), psutil.Process(watchers.proc.pid)
        mine, theirs = me.cpu_times(), browsers.cpu_times()
        sut.cpu_mark()
        t0 = time.monotonic()
        until = t0 + args.seconds
        kills: list[dict] = []
        lags: list[dict] = []
        stop_lag = asyncio.Event()
        sampler = asyncio.create_task(_sample_lag(lags, stop_lag))
        killer = asyncio.create_task(_kill(args, sut, t0 + args.kill_after, kills)) if args.kill_after else None
        say(args, f"streaming for {args.seconds:g} s" + (f"; killing at {args.kill_after:g} s" if killer else ""))
        await asyncio.gather(*(s.run(until) for s in senders))
        elapsed = time.monotonic() - t0
        cpu = sut.cpu_since_mark(elapsed)
        for name, proc, before in (("benchmark: boards", me, mine), ("benchmark: browsers", browsers, theirs)):
            now = proc.cpu_times()
            cpu[name] = round((now.user + now.system - before.user - before.system) / elapsed, 3)
        if killer is not None:
            await killer
            for kill in kills:
                if "taken_over" in kill:
                    kill["taken_over"] = await kill["taken_over"]
        say(args, f"sent; waiting up to {args.drain:g} s for the site to store what the boards still hold")
        drained = time.monotonic()
        while any(a.outbox.acked < a.outbox.last_seq for a in agents) and time.monotonic() - drained < args.drain:
            await asyncio.sleep(0.1)
        drain_s = time.monotonic() - drained
        held = sum(a.outbox.last_seq - a.outbox.acked for a in agents)
        stop_lag.set()
        await sampler
        say(args, f"stored ({drain_s:.0f} s); waiting {GRACE_S:g} s for the browsers")
        seen_iterations, seen_steps, reconnects = await watchers.finish(GRACE_S)
        stored = await asyncio.to_thread(_stored, job_ids)
        ends = [await asyncio.to_thread(api.get, f"/api/jobs/{j}/") for j in job_ids]  # before the cancel
        say(args, "cancelling the jobs; compacting their steps")
        for j in job_ids:
            await asyncio.to_thread(api.call, "POST", f"/api/jobs/{j}/cancel/", None, (409,))
        compacted = await asyncio.to_thread(_compact, job_ids)
        after = await asyncio.to_thread(_stored, job_ids)
        result = summarize_control(
            args, senders, agents, urls, job_ids, seen_iterations, seen_steps, reconnects, stored, after, compacted,
            cpu, lags, kills, t0, elapsed,
        )  # fmt: skip
        result["jobs_at_end"] = dict(Counter(j.get("status") for j in ends))
        result["why_jobs_ended"] = sorted({j.get("message", "") for j in ends if j.get("status") in ("failed",)})[:5]
        result["drain"] = {"seconds": round(drain_s, 1), "events_still_held": held,
                           "steps_dropped_by_full_outboxes": sum(a.outbox.dropped for a in agents)}  # fmt: skip
        result.update(date=started.isoformat(), database=sut.env.get("DATABASE_URL", "sqlite (embedded)"),
                      redis=sut.redis_url if args.redis_url else "embedded")  # fmt: skip
        return result
    finally:
        if watchers is not None:
            await asyncio.to_thread(watchers.stop)
        await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
        await asyncio.to_thread(sut.stop)
