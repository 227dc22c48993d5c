"""The site's coordinators: every running job's engine `Coordinator`, with its devices' processes on their agents.

    python manage.py coordinators        # what `make run` starts: serves until SIGINT/SIGTERM

The coordinators process watches the database. A job whose devices all accepted gets a coordinator (a thread
of this process): it hosts the job's store on loopback (agents' device processes reach it through this process's
store gateway on ASTEROID_STORE_PORT, with the job's secret their `start` carries: workers/storelink.py),
tells each agent to start its device process (`start` with `coordinated`), and from then on owns the run:
iterations are committed from the events the agents send (stored by the site and added to the job's
Redis stream, webapp/jobs/eventstream.py, which this process reads without polling the database), a device whose
process dies or goes silent is recovered from (re-plan, restore, replay), and administrators' actions
(`JobAction`: remove or add a device) become graceful leaves and joins at the next iteration boundary. What the
coordinator reports (device-lost, replan, replay, recovered, device-left, device-joined) is stored, logged in
the job's words and shown live. Several coordinators processes share the running jobs through leases
(webapp/jobs/leases.py); when one dies or hangs, or the site restarts, each of its jobs' coordinators starts
again in a process that takes the lease, from the job's central replica (var/jobs/<job>/run), or from the seed
when none was made yet: the job completes with all its iterations.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from redis import RedisError

from engine import events
from engine.errors import UserError
from webapp.devices.agents import tell_agent
from webapp.devices.models import Device
from webapp.jobs import eventstream, lag, leases
from webapp.jobs.actions import enlist
from webapp.jobs.artifacts import job_dir
from webapp.jobs.ending import fail, finish
from webapp.jobs.models import Job, JobAction, JobDevice
from webapp.jobs.notify import job_log, notify
from webapp.jobs.runevents import apply_event, device_state, move
from webapp.lib.outage import Outage
from webapp.lib.pooled import give_back
from workers.storelink import Gateway

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the process looks for new jobs, cancelled jobs and administrators' actions
OFFLINE_CHECK_S = 1.0
GONE = (JobDevice.State.LEFT, JobDevice.State.LOST, JobDevice.State.STOPPED, JobDevice.State.STANDBY)  # claimed again
SITE_STOPPING = "the site is stopping"  # a coordinator stopped for this leaves its job running: it resumes
LEASE_LOST = "another coordinators process took the job over"  # (this one could not renew its lease in time)
LEFT_RUNNING = (SITE_STOPPING, LEASE_LOST)
RESEND_S = 2.0  # how often `start` is sent again to an agent whose device process has not started


# A coordinator cannot start while the database or Redis cannot be reached: its job waits, it is not failed.
_starting = Outage(log, "the database or Redis to start a job's coordinator", "its job waits for them")

_gateway: Gateway | None = None
_gateway_lock = threading.Lock()


def store_gateway(port: int | None = None) -> Gateway:
    """This process's store gateway on ASTEROID_HOST, port `port` (default ASTEROID_STORE_PORT; 0: any free one),
    started at first use."""
    global _gateway
    with _gateway_lock:
        if _gateway is None:
            tls = None
            if settings.ASTEROID_TLS:  # mutual TLS: the site CA's certificate, each board's own (webapp/sitetls.py)
                from webapp import sitetls

                tls = sitetls.gateway_context()
            gateway = Gateway(settings.ASTEROID_HOST, settings.ASTEROID_STORE_PORT if port is None else port, tls)
            gateway.start()
            _gateway = gateway
        return _gateway


def run_dir(job: Job | int) -> Path:
    """Where a job's coordinator keeps the run document and the central replica."""
    return job_dir(job) / "run"


class RemoteFleet:
    """The coordinator's devices (engine.runtime.coordinator.Fleet) as the agents run them: `spawn` tells an agent
    to start its device process, events are the ones the agents sent (read from the job's stream), a device's exit is
    its agent's `job-stopped` report or the agent going offline, and `kill_one` asks the agent to SIGKILL it."""

    def __init__(self, job_id: int, owner: str = ""):
        self.job_id, self.owner = job_id, owner  # `owner`: the lease this coordinator runs under (fencing)
        self.stream = eventstream.Reader(job_id)  # from now: what was sent before is an earlier coordinator's
        self.pending: collections.deque[dict] = collections.deque()
        self.codes: dict[str, int] = {}
        self.whys: dict[str, str] = {}
        self.offline_checked = 0.0
        self.starting: dict[str, list] = {}  # name -> [device id, start message, when sent]: until it starts

    def _row(self, name: str) -> JobDevice | None:
        return JobDevice.objects.filter(job_id=self.job_id, name=name).first()

    def spawn(self, name: str, target, cfg) -> None:
        if self.owner and not leases.holds(self.job_id, self.owner):  # another process runs the job now
            self.codes[name], self.whys[name] = 1, "not started: another coordinators process took the job over"
            return
        row = self._row(name)
        if row is None or row.state in GONE:  # a standby device taking over, or one that left coming back
            row = self._claim(name, row)
        if row is None or row.device_id is None:
            self.codes[name], self.whys[name] = 1, "cannot take part: it is disabled, failed, removed or in another job"
            return
        self.codes.pop(name, None)
        JobDevice.objects.filter(pk=row.pk).update(state=JobDevice.State.STARTING)
        notify(self.job_id, {"type": "device", "device": name, "state": JobDevice.State.STARTING})
        gateway = store_gateway()  # the job's store listens on loopback (cfg.port): boards come through the gateway
        serial = Device.objects.filter(pk=row.device_id).values_list("cert_serial", flat=True).first()
        if serial:  # over TLS, this board's certificate (its current one: a re-enrolled board's old one is not)
            gateway.admit(self.job_id, serial)
        msg = {
            "type": "start", "job": self.job_id, "coordinated": True, "name": name,
            "host": settings.ASTEROID_STORE_HOST, "port": gateway.port,
            "store_secret": gateway.open(self.job_id, cfg.port), "store_tls": gateway.tls is not None,
            "generation": cfg.options.generation, "plan": cfg.plan.to_dict(),
            "options": cfg.options.to_dict(), "predicted_iteration_s": cfg.predicted_iteration_s,
        }  # fmt: skip
        self.starting[name] = [row.device_id, msg, time.monotonic(), time.monotonic()]
        tell_agent(row.device_id, msg)

    def _claim(self, name: str, row: JobDevice | None) -> JobDevice | None:
        """A device (re)joining the job: a standby one (planned for, left out of the plan until now) taking over,
        or one that left or was lost coming back. It takes part if it is online and idle; None when not."""
        with transaction.atomic():
            device = Device.objects.select_for_update().filter(name=name).first()
            if not Job.objects.filter(pk=self.job_id, status__in=Job.ACTIVE).exists() or device is None:
                return None
            usable = device.status in (Device.Status.ONLINE, Device.Status.OFFLINE, Device.Status.BUSY)
            if not usable or device.job_id not in (None, self.job_id):
                return None
            return enlist(self.job_id, device, row)

    def _resend(self) -> None:
        """`start` again to agents whose device has not started: a message to an agent that is not connected
        (reconnecting, or not back yet after a site restart) is dropped; a repeated one is ignored."""
        t = time.monotonic()
        for entry in self.starting.values():
            if t - entry[2] > RESEND_S:
                entry[2] = t
                tell_agent(entry[0], entry[1])

    def _take(self, timeout: float) -> None:
        if timeout > 0:
            give_back()  # while it waits for its devices: fifty running jobs need not hold fifty connections
        for entry, _agent, data in self.stream.read(timeout):
            lag.event(entry)
            if data["type"] in ("device-start", "job-stopped", "device-error"):
                self.starting.pop(data["device"], None)
            if data["type"] == "job-stopped":  # the device's process ended without done or error
                if data["reason"] == "left":  # as the coordinator asked: exit status 0
                    self.codes[data["device"]] = 0
                elif data["reason"] != "cancelled":  # gone
                    self.codes[data["device"]] = -9 if "SIGKILL" in data.get("why", "") else 1
                    self.whys[data["device"]] = data.get("why") or data["reason"].replace("-", " ")
            else:
                self.pending.append(data)

    def get(self, timeout: float) -> dict | None:
        self._resend()
        if not self.pending:
            self._take(timeout)
        return self.pending.popleft() if self.pending else None

    def drain(self) -> Iterator[dict]:
        self._take(0.0)
        while self.pending:
            yield self.pending.popleft()

    def exitcode(self, name: str) -> int | None:
        if name in self.codes:
            return self.codes[name]
        t = time.monotonic()
        if self.starting and t - self.offline_checked > OFFLINE_CHECK_S:
            # a device told to start whose agent is offline will not start; one that started is watched by its
            # heartbeats on the store instead (its agent may only have lost its socket: it resends its events)
            self.offline_checked = t
            # (an agent not back yet after a site restart gets as long as a launch gives agents to accept)
            waited = [n for n, e in self.starting.items() if t - e[3] > settings.ASTEROID_ACCEPT_TIMEOUT_S]
            gone = JobDevice.objects.filter(job_id=self.job_id, device__status=Device.Status.OFFLINE)
            for row_name in gone.filter(name__in=waited).values_list("name", flat=True):
                self.codes[row_name], self.whys[row_name] = 1, "its agent went offline"
                self.starting.pop(row_name, None)
        return self.codes.get(name)

    def why(self, name: str) -> str:
        return self.whys.get(name, "exit status 1")

    def kill_one(self, name: str) -> None:
        if self.owner and not leases.holds(self.job_id, self.owner):  # the device runs another process's now
            return
        row = self._row(name)
        if row is not None and row.device_id is not None:
            tell_agent(row.device_id, {"type": "kill", "job": self.job_id})

    def __enter__(self) -> RemoteFleet:
        return self

    def __exit__(self, *exc) -> None:
        if _gateway is not None:
            _gateway.close(self.job_id)  # the run is over: its secret admits no one any more


def run_options(job: Job):
    """The engine's run options of a job (the same for every device and for its coordinator)."""
    from engine.runtime.options import RunOptions
    from webapp.catalog.models import init_of

    return RunOptions(
        **job.option_values,
        init=init_of(job.model),
        iterations=job.iterations,
        dataset=job.dataset,
        emulate=job.emulated,
        timeout_s=settings.ASTEROID_RUN_TIMEOUT_S,
        save_model=True,
        steps_every_s=settings.ASTEROID_STEPS_EVERY_S,
    )


def coordinator_for(job: Job, owner: str = ""):
    """The engine Coordinator of a job whose devices all accepted; resumed from its central replica when an
    earlier coordinators process had made one (the site restarted mid-job, or that process died). With `owner`,
    what it reports and starts is fenced by the lease: once another process holds it, nothing more goes out."""
    from engine.runtime.central import load_resume
    from engine.runtime.coordinator import Coordinator
    from engine.workloads import workload

    plan = job.plan_object  # the newest generation's: its devices were alive when the site stopped
    w = workload(job.model, cluster=plan.cluster)
    directory = run_dir(job)
    resume = load_resume(directory)[1] if (directory / "central.pt").exists() else None
    return Coordinator(
        plan,
        w,
        run_options(job),
        emit=lambda ev: _report(job.pk, owner, ev),
        run_dir=directory,
        resume=resume,
        fleet=RemoteFleet(job.pk, owner),
        detect_s=settings.ASTEROID_DETECT_S,
        first_generation=len(job.generations),  # a restarted site's run goes on numbering its generations
    )


def _report(job_id: int, owner: str, ev: dict) -> None:
    """What a coordinator reports itself, while `owner` holds the job's lease (the devices' events it passes on
    were stored by the site already)."""
    if ev.get("type") in events.sent_by("coordinator") and (not owner or leases.holds(job_id, owner)):
        apply_event(job_id, ev)


def coordinate(job_id: int, ready: threading.Event | None = None, registry: dict | None = None, owner: str = "") -> str:
    """Run job `job_id`'s coordinator to the end of the run; the job ends completed or failed with the reason
    (unless `owner` no longer holds its lease by then: the process that does decides)."""
    from engine.runtime.coordinator import RunFailed

    try:
        job = Job.objects.get(pk=job_id)
        coordinator = coordinator_for(job, owner)
    except (RedisError, OperationalError, InterfaceError) as exc:  # started again at the next watch, once back
        _starting.failed(exc)
        return "stopped"
    except UserError as exc:
        fail(job, f"cannot coordinate the run: {exc}")
        return "failed"
    except Exception as exc:  # a bug: fail the job once rather than start its coordinator again and again
        log.exception("starting the coordinator of job %s", job_id)
        fail(job, f"cannot coordinate the run: {type(exc).__name__}: {exc}")
        return "failed"
    _starting.reached()
    at = coordinator.resume["iteration"] if coordinator.resume is not None else 0
    first = {
        "generation": coordinator.first_generation, "plan": job.plan,
        "reason": "resumed" if job.generations else "start", "start": at, "planning_real_s": 0.0,
        "predicted_throughput": job.predicted_throughput or 0.0,
    }  # fmt: skip
    Job.objects.filter(pk=job.pk).update(generations=[*job.generations, first])
    move(job, Job.Status.RECOVERING, Job.Status.RUNNING, "training (resumed)")
    if job.generations:  # a coordinator ran this job before: the site restarted, or another process took it over
        for name in job.device_names:  # their device processes start again (what they trained is in the replica)
            device_state(job, name, JobDevice.State.STARTING)
        where = "its central replica" if coordinator.resume is not None else "the seed: no central replica yet"
        job_log(job, f"the coordinator started again (the site restarted, or its coordinators process died): the "
                     f"run resumes from iteration {at} ({where})", "warning")  # fmt: skip
    if registry is not None:
        registry[job_id] = coordinator
    if ready is not None:
        ready.set()
    try:
        coordinator.run()
        if owner and not leases.holds(job_id, owner):
            return "stopped"
        finish(job)
        return "completed"
    except RunFailed as exc:
        # the next coordinators process takes the job up again (or has: this one's lease is gone)
        handed_over = owner and not leases.holds(job_id, owner)
        if coordinator.stop_reason in LEFT_RUNNING or handed_over:
            if coordinator.stop_reason == SITE_STOPPING:
                log.info("job %s: coordinator stopped with the site; the run resumes when it starts again", job_id)
            else:
                log.warning("job %s: coordinator stopped: %s", job_id, LEASE_LOST)
            return "stopped"
        job.refresh_from_db()
        if not job.finished:
            fail(job, str(exc))
        return "failed"
    except Exception as exc:  # a bug: the job must not stay running forever; the traceback goes to the log
        log.exception("coordinating job %s", job_id)
        if owner and not leases.holds(job_id, owner):
            return "stopped"
        fail(job, f"the coordinator failed: {type(exc).__name__}: {exc}")
        return "failed"
    finally:
        if registry is not None:
            registry.pop(job_id, None)
        connection.close()  # this thread's own database connection


class Coordinators:
    """The coordinator threads of the running jobs this process holds leases on (webapp/jobs/leases.py), and the
    administrators' actions they carry out."""

    def __init__(self, owner: str | None = None) -> None:
        self.owner = owner or leases.this_process()
        self.threads: dict[int, threading.Thread] = {}
        self.running: dict[int, object] = {}  # job id -> its Coordinator, once it runs
        self.renewed = 0.0

    def step(self) -> None:
        """Renew this process's leases (stopping coordinators whose lease another process took); start coordinators
        of jobs whose lease it wins; stop those of cancelled jobs; hand over pending actions."""
        ended = [job_id for job_id, thread in self.threads.items() if not thread.is_alive()]
        for job_id in ended:
            del self.threads[job_id]
        leases.release(ended, self.owner)  # (a no-op for a job another process took over)
        if time.monotonic() - self.renewed > settings.ASTEROID_LEASE_S / 4:
            kept = leases.renew(list(self.threads), self.owner)
            self.renewed = time.monotonic()
            for job_id in set(self.threads) - kept:
                coordinator = self.running.get(job_id)
                if coordinator is not None:
                    log.warning("job %s: its lease was taken over; stopping this process's coordinator", job_id)
                    coordinator.stop(LEASE_LOST)
        wanted = leases.share(leases.unowned(exclude=list(self.threads)), self.owner, len(self.threads))
        for job_id in leases.claim(wanted, self.owner):
            thread = threading.Thread(
                target=coordinate,
                args=(job_id, None, self.running, self.owner),
                name=f"coordinator-{job_id}",
                daemon=True,
            )
            self.threads[job_id] = thread
            thread.start()
            log.info("job %s: coordinator started", job_id)
        running = dict(self.running)  # one query for every running job's status, not one each per watch
        for job_id, status in Job.objects.filter(pk__in=running, status__in=Job.FINISHED).values_list("pk", "status"):
            running[job_id].stop(f"the job was {status}")
        for action in JobAction.objects.filter(done_at__isnull=True, kind__in=("remove", "add")).select_related("job"):
            coordinator = self.running.get(action.job_id)
            if coordinator is None or coordinator.generation is None:
                if action.job.finished:
                    _done(action, f"not done: the job had {action.job.status}")
                continue  # its coordinator is starting: the action waits for it
            try:
                _carry_out(action, coordinator)
            except Exception as exc:  # e.g. a device whose probe cannot be planned with: said, never retried
                log.exception("job %s: %s %s", action.job_id, action.kind, action.device)
                _done(action, f"not done: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        for coordinator in list(self.running.values()):
            coordinator.stop(SITE_STOPPING)
        for thread in list(self.threads.values()):
            thread.join(10)
        leases.release(list(self.threads), self.owner)  # the next process takes them up at once


def _carry_out(action: JobAction, coordinator) -> None:
    who = action.user.get_username() if action.user else "an administrator"
    if action.kind == JobAction.Kind.REMOVE:
        coordinator.leave(action.device)
        _done(action, f"asked by {who}: leaves at the next iteration boundary")
        return
    device = Device.objects.filter(name=action.device).first()
    if device is None:
        _done(action, "not done: the device is no longer registered")
        return
    coordinator.join(device.to_engine(action.job.bandwidth_mbps))
    _done(action, f"asked by {who}: joins at the next iteration boundary")


def _done(action: JobAction, outcome: str) -> None:
    JobAction.objects.filter(pk=action.pk).update(done_at=timezone.now(), outcome=outcome)


class _Stop(Exception):
    pass


def serve(store_port: int | None = None) -> int:
    """The coordinators process: until SIGINT or SIGTERM. `store_port`: its store gateway's (default
    ASTEROID_STORE_PORT; each of several coordinators processes on one host needs its own)."""

    def on_signal(signum, frame):
        raise _Stop

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    port = settings.ASTEROID_STORE_PORT if store_port is None else store_port
    if not settings.REDIS_URL:
        log.error("coordinators: device events reach the coordinators through Redis: set REDIS_URL "
                  "(`make run` starts an embedded one)")  # fmt: skip
        return 1
    try:
        gateway = store_gateway(port)
    except OSError as exc:
        log.error("coordinators: cannot serve the store gateway on %s:%s: %s (set ASTEROID_STORE_PORT)",
                  settings.ASTEROID_HOST, port, exc.strerror or exc)  # fmt: skip
        return 1
    coordinators = Coordinators()
    log.info("coordinators: serving (jobs' store gateway on %s:%s)", settings.ASTEROID_HOST, gateway.port)
    try:
        while True:
            woke = time.monotonic()
            try:
                coordinators.step()
                lag.publish(coordinators.owner, len(coordinators.threads))
            except _Stop:
                raise
            except Exception:  # a database or Redis hiccup must not take every running job's coordinator down
                log.exception("coordinators: watching the jobs")
            time.sleep(WATCH_S)
            lag.loop(time.monotonic() - woke - WATCH_S)  # late by what the step took beyond the sleep
    except _Stop:
        coordinators.stop()
    return 0
