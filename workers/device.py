"""This device's part of a run: the device process of an assigned job, its events, its uploaded model part.

    runner = Runner(site, credential, outbox)
    accepted = runner.assign(msg)   # blocking (may profile the model): call it off the event loop
    runner.start(msg)               # returns at once; a supervisor thread runs the process and relays its events
    runner.cancel(job)              # SIGTERM, then SIGKILL after KILL_AFTER_S; a `job-stopped` event follows

The device process runs `engine.runtime.worker.run_device` exactly as `python -m engine train --rank` does
(rank 0 serves the rendezvous store, on a port this agent picked when it accepted), started and watched by
the runtime's own `engine.runtime.processes.DeviceProcesses`. A supervisor thread per run relays its events
(the catalogue's, engine/events.py) to the outbox, uploads the model part carried by `device-done`, and
reports a process that died without saying why.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from engine.errors import UserError
from engine.events import DeviceError, JobStopped
from engine.recipe import planned
from workers.outbox import Outbox
from workers.site import HttpError, NotHttp, Site
from workers.storelink import Relay

log = logging.getLogger("workers.device")

SUPERSEDED = "superseded"  # a process stopped because its job's coordinator started a later generation here
KILL_AFTER_S = 3.0  # a cancelled device process gets this long to die of SIGTERM before SIGKILL
TRACEBACK_CHARS = 20_000  # keeps an events message under the site's 256 KiB frame limit
UPLOAD_TRIES = 5


def free_port() -> int:
    """A TCP port free on every interface now, for rank 0's rendezvous store (bound later by the device process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def upload_part(site: Site, credential: str, job, data: bytes) -> None:
    """POST a trained stage's `torch.save(state_dict)` bytes; retries while the site is unreachable or failing."""
    delay = 1.0
    for attempt in range(1, UPLOAD_TRIES + 1):
        try:
            site.post(f"/api/agent/jobs/{job}/part/", data, "application/octet-stream", credential)
            return
        except HttpError as exc:
            if exc.status < 500 or attempt == UPLOAD_TRIES:
                raise
        except OSError as exc:
            if attempt == UPLOAD_TRIES or isinstance(exc, NotHttp):  # not HTTP there: asking again does not help
                raise
        time.sleep(delay)  # waiting out a site restart, on the supervisor thread (never the event loop)
        delay *= 2


class Runner:
    """At most one job at a time: assigned (prepared), then running (a device process), then idle again."""

    def __init__(self, site: Site, credential: str, outbox: Outbox, workload: Callable | None = None):
        self.site, self.credential, self.outbox = site, credential, outbox
        self._workload = workload  # model name -> engine Workload; None: the host's cached profile
        self.device = ""  # the site's name for this device (from `welcome`), for events of jobs it could not take
        self.address = ""  # this board's address on its route to the site: its data plane binds there (agent's hello)
        self.clock = None  # this board's clock against the site's (workers.clock.ClockSync; the connection sets it)
        self._lock = threading.Lock()
        self._next: dict | None = None  # a coordinated `start` of the next job, held while this one winds down
        self._clear()

    def _clear(self) -> None:
        self._job = None
        self._name = ""
        self._cfg = None
        self._port: int | None = None
        self._procs = None
        self._thread: threading.Thread | None = None
        self._stop_reason: str | None = None  # set when the agent ends the run (cancel, shutdown)
        self._winding_down = False  # its process reported `device-done`: it is uploading its part and exiting
        self._store_relay: Relay | None = None  # the run's authenticated path to its store (coordinated runs)

    @property
    def job(self):
        return self._job

    @property
    def pid(self) -> int | None:
        """The pid of the device process running now, if one is."""
        procs = self._procs
        return procs.pid(self._name) if procs is not None and procs.running else None

    @property
    def state(self) -> str:
        return "idle" if self._job is None else "busy"

    # -- messages from the site -------------------------------------------------------------------------

    def assign(self, msg: dict) -> dict:
        """Prepare this device's part of the run in `msg`; the `accepted` reply. Raises UserError when it
        cannot take part (busy, malformed plan, rank out of range). Blocking: profiles the model on first use."""
        from engine.costmodel import score
        from engine.plan import Plan
        from engine.runtime.config import DeviceConfig
        from engine.runtime.options import RunOptions
        from engine.steps import device_steps

        job = msg.get("job")
        with self._lock:
            if self._job is not None and self._job == job:  # the site asked again (our reply was lost in a reconnect)
                return {"type": "accepted", "job": job, "port": self._port}
            ending = self._thread if self._job is not None and self._ending() else None
        if ending is not None:  # a job the site finished or cancelled a moment ago and already freed this device
            ending.join(KILL_AFTER_S + 5)  # of: its process is on its way out (KILL_AFTER_S at most)
        with self._lock:
            if self._job is not None:
                raise UserError(f"this device is busy with job {self._job}")
        rank = msg.get("rank")
        if type(rank) is not int:
            raise UserError("assign needs an integer rank")
        plan = Plan.from_dict(msg.get("plan"))
        if not 0 <= rank < len(plan.device_names):
            raise UserError(f"rank {rank} is not in the plan, which has {len(plan.device_names)} devices")
        options = RunOptions.from_dict(msg.get("options") or {})
        w = self._workload(plan.model) if self._workload else _profiled(plan.model, plan.cluster)
        plan.validate(w.num_layers)
        w = planned(w, options)  # as the site planned it: the job's optimizer state, its frozen weights
        name = plan.device_names[rank]
        if self.device and name != self.device:  # the plan's name is what its peers and events use; go along
            log.warning("job %s: the plan calls this device %s, the site calls it %s", job, name, self.device)
        steps, predicted = device_steps(plan, w)[name], score(plan, w).iteration_s
        cfg = DeviceConfig(plan, steps, rank, "", 0, options, rank == 0, predicted)  # host and port from `start`
        port = free_port() if rank == 0 else None
        with self._lock:
            if self._job is not None:
                raise UserError(f"this device is busy with job {self._job}")
            self._job, self._name, self._cfg, self._port = job, name, cfg, port
        log.info("job %s: accepted as %s (rank %d of %d)", job, name, rank, cfg.world_size)
        return {"type": "accepted", "job": job, "port": port}

    def start(self, msg: dict) -> None:
        """Start the device process against the store at `host:port`; returns at once. A `coordinated` start
        (the site's coordinator spawns this device into generation `generation` as `name`) carries the plan
        and the options itself: it needs no `assign` before it (a standby device, a join, a resumed run)."""
        job, host, port = msg.get("job"), msg.get("host"), msg.get("port")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise UserError(f"start of job {job} needs a host and a port, got {host!r}:{port!r}")
        coordinated = msg.get("coordinated") is True
        if coordinated and "store_secret" in msg and self.clock is not None and not self.clock.ready:
            # a site that hosts the store answers clock probes: the estimate is a few probes away, and the
            # coordinator sends `start` again every 2 s until the device starts
            log.info("job %s: waiting for this board's clock estimate before starting", job)
            return
        spawned = _coordinated_config(msg, host, port) if coordinated else None
        with self._lock:
            if coordinated and self._job not in (None, job) and self._ending():
                # the site freed this device when its last job ended; the process is still uploading its part or
                # exiting: start this one the moment it is gone (_finish), rather than refuse a device that is free
                log.info("job %s: starting once job %s's device process has exited", job, self._job)
                self._next = msg
                return
            if coordinated and self._job not in (None, job):
                raise UserError(f"this device is busy with job {self._job}")
            if coordinated and self._superseded(job, spawned.options.generation):
                # the job's coordinator moved on without this process (it was taken for lost, or another
                # coordinators process took the job over): stop it, then start the new generation's (_finish)
                log.info("job %s: generation %d supersedes this device's; stopping its process", job,
                         spawned.options.generation)  # fmt: skip
                self._next = msg
                self._stop_reason = self._stop_reason or SUPERSEDED
                if self._procs is not None:  # at once: it may hang on its old store, and holds nothing to save
                    self._procs.kill()
                return
            if coordinated and self._thread is None:
                self._job, self._name, self._cfg, self._port = job, spawned.name, spawned, None
            if job != self._job or self._cfg is None:
                raise UserError(f"start of job {job}, which this device has not accepted")
            if self._thread is not None:
                return  # already started (a repeated start after a reconnect)
            cfg = self._cfg if coordinated else replace(self._cfg, host=host, port=port)
            clock = self.clock  # the run's times are the site's: step times, link arrivals, fault times
            cfg = replace(cfg, address=self.address, time_base=clock.to_dict() if clock and clock.ready else None)
            if coordinated and isinstance(msg.get("store_secret"), str):
                # the device process's store clients go through this agent's relay to the site's store gateway
                tls = self.site.tls if msg.get("store_tls") else None  # mutual TLS with the gateway: our board cert
                if msg.get("store_tls") and tls is None:
                    raise UserError(
                        f"job {job}: the site's store gateway speaks TLS, and this agent has no board "
                        "certificate: enroll it again with a new token (and the Add device line's CA=)"
                    )
                relay = Relay(host, port, job, msg["store_secret"], tls)
                try:
                    cfg = replace(cfg, host="127.0.0.1", port=relay.start())
                except OSError as exc:
                    raise UserError(f"cannot relay job {job}'s store on this board's loopback: {exc}") from None
                self._store_relay = relay
            self._thread = threading.Thread(
                target=self._supervise, args=(job, cfg), name=f"device-job-{job}", daemon=True
            )
            self._thread.start()

    def _superseded(self, job, generation: int) -> bool:
        """Whether a start of `job`'s `generation` finds this device's process in an earlier one of that job."""
        running = self._cfg.options.generation if self._cfg is not None else None
        return self._job == job and self._thread is not None and running is not None and generation > running

    def _ending(self) -> bool:
        """Whether the current run is over but for its process exiting (it finished, or the agent stopped it)."""
        return self._winding_down or self._stop_reason is not None

    def kill(self, job) -> None:
        """SIGKILL `job`'s device process (fault injection by the site's staff): it is reported as died."""
        with self._lock:
            if job != self._job or self._procs is None:
                raise UserError(f"job {job} has no device process running here")
            self._procs.kill()
        log.warning("job %s: device process killed (SIGKILL) at the site's request", job)

    def cancel(self, job) -> None:
        """Stop `job`'s device process; a `job-stopped` event reports it (at once when it had not started)."""
        self._stop(job, "cancelled")

    def shutdown(self, timeout: float = KILL_AFTER_S + 5) -> None:
        """Stop any run because the agent is stopping, and wait for its process to be gone."""
        thread = self._thread
        if self._job is not None:
            self._stop(self._job, "agent-stopped")
        if thread is not None:
            thread.join(timeout)

    def refuse(self, job, message: str, own: bool = True) -> None:
        """Tell the site this device cannot take part in `job`: a `device-error` (with `own`: its failure), then
        `job-stopped` rejected, saying why."""
        with self._lock:
            name = self._name if job == self._job else self.device
            if job == self._job and self._thread is None:
                self._clear()
        if own:
            self.outbox.add(job, DeviceError(name, -1, message).to_message())
        self.outbox.add(job, JobStopped(name, "rejected", "" if own else message).to_message())

    def _stop(self, job, reason: str) -> None:
        with self._lock:
            if self._next is not None and self._next.get("job") == job:
                self._next = None  # a held start of the job stopped: it never runs here
            if job != self._job or self._thread is None:
                # not running: nothing to kill, but the site still hears that the job is over here
                name = self._name if job == self._job else self.device
                if job == self._job:
                    self._clear()
                self.outbox.add(job, JobStopped(name, reason).to_message())
                log.info("job %s: %s before it started", job, reason)
                return
            # a cancel (or the agent stopping) while a superseded process exits: that is how this run ends now
            self._stop_reason = reason if self._stop_reason in (None, SUPERSEDED) else self._stop_reason
            if self._procs is not None:
                self._procs.terminate()
        log.info("job %s: stopping the device process (%s)", job, reason)

    # -- the device process -----------------------------------------------------------------------------

    def _supervise(self, job, cfg) -> None:
        """Run the device process and relay its events until it exits; then report how it ended."""
        from engine.runtime.processes import DeviceProcesses
        from engine.runtime.worker import run_device

        seen = _Seen()
        procs = DeviceProcesses()
        procs.add(self._name, run_device, cfg)
        try:
            procs.start()  # the first start also starts the fork server (it imports torch once)
        except Exception as exc:  # no process: report it like one that died at start-up
            procs.close()
            self._finish(job, None, seen, f"cannot start the device process: {exc}")
            return
        with self._lock:
            self._procs = procs
            if self._stop_reason is not None:  # cancelled while it was starting
                procs.terminate()
        relay = self._store_relay
        where = f"store {cfg.host}:{cfg.port}"
        if relay is not None:
            where = f"store via the gateway {relay.gateway[0]}:{relay.gateway[1]}"
        place = f"generation {cfg.options.generation}" if cfg.coordinated else f"rank {cfg.rank}"
        log.info("job %s: device process %d started as %s (%s, %s)", job, procs.pid(self._name), self._name, place,
                 where)  # fmt: skip
        stopping_since = None
        while True:
            ev = procs.get(timeout=0.2)
            if ev is not None:
                self._relay(job, ev, seen)
            elif not procs.running:
                break
            if self._stop_reason is not None:
                stopping_since = stopping_since or time.monotonic()
                if time.monotonic() - stopping_since > KILL_AFTER_S:
                    procs.kill()  # SIGTERM was not enough (stuck in a native call)
        for ev in procs.drain():  # what it wrote just before exiting
            self._relay(job, ev, seen)
        procs.close()
        code = procs.exitcode(self._name)
        how = procs.why(self._name)  # "died (SIGKILL)"
        self._finish(job, code, seen, how if cfg.coordinated else f"device process {how} without reporting an error")

    def _relay(self, job, ev: dict, seen: _Seen) -> None:
        kind = ev.get("type")
        if kind == "device-start":
            seen.iteration = max(seen.iteration, 0)  # training: iteration 0 is under way
            where = ev.get("compute") or "cpu"
            log.info("job %s: device %s training on %s (dilation %s)", job, ev.get("device"), where, ev.get("dilation"))
        elif kind == "step":
            seen.iteration = max(seen.iteration, ev.get("iteration", -1))
        elif kind == "device-error":
            seen.error = True
            ev["traceback"] = ev.get("traceback", "")[-TRACEBACK_CHARS:]
            if ev.get("cause") == "peer":  # a peer or the store gone: its coordinator decides what that means
                log.info("job %s: device %s stopped: %s", job, ev.get("device"), ev.get("message"))
            else:
                log.warning("job %s: device %s failed: %s", job, ev.get("device"), ev.get("message"))
        elif kind == "device-done":
            seen.done = self._winding_down = True
            ev["part"] = self._upload(job, ev)
        elif kind == "iteration" and not math.isfinite(ev.get("loss") or 0.0):
            ev["loss"] = None  # a diverged run's NaN or infinite loss: JSON has no such number
        self.outbox.add(job, ev)

    def _upload(self, job, ev: dict) -> bool:
        data = ev.pop("state_dict", b"")
        if not data:
            return False
        try:
            upload_part(self.site, self.credential, job, data)
        except (HttpError, OSError) as exc:
            ev["part_error"] = f"upload of the model part failed: {exc}"
            log.error("job %s: %s", job, ev["part_error"])
            return False
        log.info("job %s: model part uploaded (%d bytes)", job, len(data))
        return True

    def _finish(self, job, code: int | None, seen: _Seen, failure: str) -> None:
        """Report how the run ended (`failure`: what to say when the process failed silently); back to idle."""
        name, reason = self._name, self._stop_reason
        why = ""
        if reason is None and code != 0 and not seen.error:
            if self._cfg.coordinated:  # a lost device, for the coordinator to recover from: not an error of its own
                why = failure
            else:
                self.outbox.add(job, DeviceError(name, seen.iteration, failure).to_message())
            log.warning("job %s: %s", job, failure)
            reason = "died"
        if reason is None and code == 0 and not seen.done and self._cfg.coordinated:
            reason = "left"  # the coordinator let it go (a graceful leave, or a new plan without it)
        # A cancel always gets its reply; an agent stopping just after the device finished ended nothing; a
        # superseded process is news to nobody (its coordinator moved on, and the next start follows).
        if reason == "cancelled" or (reason not in (None, SUPERSEDED) and not seen.done):
            self.outbox.add(job, JobStopped(name, reason, why).to_message())
        log.info("job %s: finished (%s)", job, reason or ("done" if seen.done else f"exit status {code}"))
        with self._lock:
            if self._store_relay is not None:
                self._store_relay.stop()
            self._clear()
            held, self._next = self._next, None
        if held is not None:  # the next job's start, held while this run wound down
            try:
                self.start(held)
            except UserError as exc:
                log.warning("cannot start job %s: %s", held.get("job"), exc)
                self.refuse(held.get("job"), str(exc), own=False)


class _Seen:
    """What a run's events told the supervisor: the iteration reached, whether it reported an error or finished."""

    def __init__(self) -> None:
        self.iteration, self.error, self.done = -1, False, False


def _coordinated_config(msg: dict, host: str, port: int):
    """The device process's config from a coordinated `start`; UserError when a field is missing or wrong."""
    from engine.plan import Plan
    from engine.runtime.config import DeviceConfig
    from engine.runtime.options import RunOptions

    name, generation, predicted = msg.get("name"), msg.get("generation"), msg.get("predicted_iteration_s")
    if not isinstance(name, str) or not name or type(generation) is not int or generation < 0:
        raise UserError(f"a coordinated start of job {msg.get('job')} needs a device name and a generation")
    if not isinstance(predicted, (int, float)) or not 0 < predicted < 1e6:
        raise UserError(f"a coordinated start of job {msg.get('job')} needs a positive predicted_iteration_s")
    plan = Plan.from_dict(msg.get("plan"))
    options = replace(RunOptions.from_dict(msg.get("options") or {}), generation=generation)
    return DeviceConfig(plan, None, 0, host, port, options, predicted_iteration_s=float(predicted), coordinated=True,
                        name=name)  # fmt: skip


def _profiled(model: str, cluster):
    from engine.workloads import workload

    return workload(model, cluster=cluster)  # a probed device's predicted times, as the site planned with
