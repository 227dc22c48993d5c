"""The agent's log lines about a job, sent to the site as `agent-log` events (engine/events.py) beside its
other events, so that the job's live page shows each board's own account of it: every line of the agent that
starts "job N:" (what the runner says of the job: accepted, started, stopped, uploaded, failed)."""

from __future__ import annotations

import logging
import threading

from engine.events import AgentLog
from workers.outbox import Outbox

MAX_CHARS = 2000  # of a line (a traceback's last lines fit)


class JobLog(logging.Handler):
    """A handler on the agent's "workers" logger: a record whose message is "job %s: ..." goes to that job's
    events too."""

    def __init__(self, outbox: Outbox, device: str = "") -> None:
        super().__init__(logging.INFO)
        self.outbox, self.device = outbox, device
        self._inside = threading.local()  # a line the outbox itself logs while adding one is not sent again

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._inside, "busy", False):
            return
        if not (isinstance(record.msg, str) and record.msg.startswith("job %s") and record.args):
            return
        job = record.args[0] if isinstance(record.args, tuple) else None
        if not isinstance(job, int):
            return
        self._inside.busy = True
        try:
            line = record.getMessage()[:MAX_CHARS]
            event = AgentLog(self.device, record.levelname, line, record.created)
            self.outbox.add(job, event.to_message())
        except Exception:  # a log line must never break the agent
            self.handleError(record)
        finally:
            self._inside.busy = False
