"""The agent's lines about a job go to the site as `agent-log` events (workers/joblog.py)."""

import logging

from engine.events import AgentLog, parse
from workers.joblog import JobLog
from workers.outbox import Outbox


def test_a_line_about_a_job_becomes_its_event_and_others_do_not():
    outbox = Outbox()
    handler = JobLog(outbox)
    log = logging.getLogger("workers.device")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        log.info("job %s: accepted as %s (rank %d of %d)", 7, "nano-1", 1, 3)
        log.warning("job %s: device %s failed: %s", 7, "nano-1", "out of memory")
        log.info("measuring this device...")  # not about a job
        log.info("job %s: odd", "seven")  # not a job number
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    sent = outbox.pending()
    events = [parse(e["event"]) for e in sent]
    assert [e["job"] for e in sent] == [7, 7] and all(isinstance(e, AgentLog) for e in events)
    assert events[0].message == "job 7: accepted as nano-1 (rank 1 of 3)" and events[0].severity == "INFO"
    assert events[1].severity == "WARNING" and events[1].message.endswith("out of memory")
