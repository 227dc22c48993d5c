"""The `live` run: enroll, start the agent, create and launch the job, subscribe, send on schedule, report."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from datetime import UTC, datetime

from engine.events import DeviceStart, Iteration
from workers.sitebench import (
    BATCH_SIZE,
    CLOSE_TIMEOUT_S,
    GRACE_S,
    ITERATIONS,
    MODEL,
    PLAN_TIMEOUT_S,
    START_TIMEOUT_S,
    BenchError,
)
from workers.sitebench.agent import BenchAgent
from workers.sitebench.api import Api, create_token, enrollment, socket_url, wait_for_status
from workers.sitebench.cli import parse_args
from workers.sitebench.stats import render, summarize
from workers.sitebench.subscribers import Subscribers


def say(args, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


async def send_iterations(agent: BenchAgent, job: int, rate: float, seconds: float, batch: int) -> dict:
    """The open-loop sender: event i is due at t0 + i / rate, added to the outbox `batch` at a time when the
    first of them is due; the agent's connection sends them. An event's send time is when it was added."""
    total = round(rate * seconds)
    interval = batch / rate
    sent_at: dict[int, float] = {}
    lateness: list[float] = []
    seqs: list[int] = []
    t0 = time.monotonic() + 0.05
    for k in range(math.ceil(total / batch)):
        due = t0 + k * interval
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        agent.check_alive()
        now = time.monotonic()
        lateness.append(max(0.0, now - due))
        for i in range(k * batch, min(total, (k + 1) * batch)):
            event = Iteration(
                iteration=i,
                loss=2.3 * math.exp(-3.0 * i / total),
                iteration_s=1.0 / rate,
                throughput=BATCH_SIZE * rate,
                steps=4 * (i + 1),
                time=round(now - t0, 6),  # seconds since the first send: the send time, recoverable from the event
            ).to_message()
            seqs.append(agent.outbox.add(job, event))
            sent_at[i] = now
    return {"t0": t0, "end": time.monotonic(), "sent_at": sent_at, "seqs": (seqs[0], seqs[-1]), "lateness": lateness}


async def run_live(args) -> dict:
    from workers.enroll import enroll
    from workers.site import Site

    started = datetime.now(UTC)
    token = args.token.strip() if args.token else None
    if token is None:
        say(args, f"creating an API token: manage.py createtoken {args.user}")
        token = await asyncio.to_thread(create_token, args.user)
    api = Api(args.url, token)
    await asyncio.to_thread(api.get, "/api/jobs/")  # reachable, and the token works
    device, enrollment_token = await asyncio.to_thread(enrollment, api, args.device)
    site = Site.parse(args.url)
    state = await asyncio.to_thread(enroll, site, enrollment_token, 1)
    say(args, f"device {args.device} enrolled; agent connecting to {site.socket_url}")
    agent = BenchAgent(site, state.credential)
    subscribers: Subscribers | None = None
    job_id = None
    result: dict = {}
    try:
        await agent.start()
        job = await asyncio.to_thread(
            api.post,
            "/api/jobs/",
            {"model": MODEL, "dataset": "synthetic", "batch_size": BATCH_SIZE, "iterations": ITERATIONS,
             "devices": [agent.name or args.device]},
        )  # fmt: skip
        job_id = job.get("id")
        if type(job_id) is not int:
            raise BenchError("the site's reply to POST /api/jobs/ has no job id")
        say(args, f"job {job_id} created; waiting for the site to plan it")
        await wait_for_status(api, job_id, "planned", PLAN_TIMEOUT_S)
        agent.runner.expected = job_id
        await asyncio.to_thread(api.post, f"/api/jobs/{job_id}/launch/")
        if not await agent.until(agent.runner.started, START_TIMEOUT_S):
            raise BenchError(f"job {job_id} was launched but the site sent no start within {START_TIMEOUT_S:.0f} s")
        agent.outbox.add(job_id, DeviceStart(device=agent.name, rank=0, stage=0, pid=os.getpid()).to_message())
        say(args, f"job {job_id} running; connecting {args.subscribers} subscribers")
        subscribers = Subscribers(socket_url(args.url, f"/ws/jobs/{job_id}/"), token, args.subscribers)
        await subscribers.ready()
        say(args, f"sending {args.rate:g} events/s for {args.seconds:g} s, {args.batch} at a time")
        try:
            async with asyncio.timeout(args.seconds * 2 + 30):  # the sender falls behind only if adds block
                sent = await send_iterations(agent, job_id, args.rate, args.seconds, args.batch)
        except TimeoutError:
            raise BenchError(f"sending took over {args.seconds * 2 + 30:.0f} s: the agent stopped keeping up") from None
        say(args, f"sent; waiting up to {GRACE_S:g} s for the subscribers to receive everything")
        records, messages, statuses, ended = await subscribers.finish(len(sent["sent_at"]), GRACE_S)
        final = await asyncio.to_thread(api.get, f"/api/jobs/{job_id}/")
        result = summarize(args, sent, records, agent, messages, statuses, ended)
        result.update(job=job_id, device=agent.name, job_status_at_end=final.get("status"), date=started.isoformat())
    finally:
        if subscribers is not None:
            await asyncio.to_thread(subscribers.stop)
        if job_id is not None:
            await _cancel(api, agent, job_id)
        await agent.close()
    return result


async def _cancel(api: Api, agent: BenchAgent, job_id: int) -> None:
    """Cancel the job (a finished one stays as it is) and let the agent's `job-stopped` be stored."""
    try:
        await asyncio.to_thread(api.call, "POST", f"/api/jobs/{job_id}/cancel/", None, (409,))
    except BenchError as exc:
        print(f"warning: could not cancel job {job_id}: {exc}", file=sys.stderr)
        return
    if agent.runner.accepted is None:
        return
    try:
        if await agent.until(agent.runner.cancelled, CLOSE_TIMEOUT_S):
            await agent.until_acked(agent.runner.stopped_seq, CLOSE_TIMEOUT_S)
    except BenchError:
        pass  # the connection ended: closing the agent says what it can


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "control":
            from workers.sitebench.control import run_control
            from workers.sitebench.tally import render_control

            result = asyncio.run(run_control(args))
            print(json.dumps(result, indent=2) if args.json else render_control(result))
            return 0
        result = asyncio.run(run_live(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a benchmark reports any failure as one line, never a traceback
        from engine.errors import UserError

        if isinstance(exc, UserError):
            print(f"error: {exc}", file=sys.stderr)
        else:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
