"""The devices' event streams across a Redis outage: the site holds what it stored, a coordinator's read waits, and
once the same Redis is back (empty, as `make run` starts it again) every event reaches the reader once, in order."""

import logging

import pytest

from tests.webapp.conftest import kill
from webapp.jobs import eventstream

pytestmark = pytest.mark.django_db


def step(n: int) -> dict:
    return {"type": "iteration", "iteration": n}


def test_events_stored_while_redis_is_down_reach_the_coordinator_once_it_is_back(own_redis, caplog):
    caplog.set_level(logging.INFO, logger="webapp.jobs.eventstream")
    reader = eventstream.Reader(7)
    assert eventstream.publish([(7, "nx-0", "s1", 1, step(0))]) is True
    assert [e for _, _, e in reader.read(1.0)] == [step(0)]

    kill(own_redis)
    assert eventstream.publish([(7, "nx-0", "s1", 2, step(1))]) is False  # stored by the site: held here
    assert eventstream.publish([(7, "nx-0", "s1", 3, step(2))]) is False
    assert reader.read(0.1) == [] and reader.read(0.1) == []  # the coordinator waits; it does not fail
    assert eventstream.flush() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one line for the site's side, one for the reader's, not one per call
    assert all(w.startswith("cannot reach Redis for the coordinators' event streams") for w in warnings)

    assert own_redis.revive() is not None  # `make run` starts it again on its port, empty
    assert eventstream.flush() is True
    # A batch whose agent sent it again (its socket closed during the outage) is streamed again; read once.
    eventstream.publish([(7, "nx-0", "s1", 3, step(2)), (7, "nx-0", "s1", 4, step(3))])
    got = []
    for _ in range(10):
        got += [e for _, _, e in reader.read(0.5)]
        if len(got) >= 3:
            break
    assert got == [step(1), step(2), step(3)]
    assert sum("can be reached again" in r.getMessage() for r in caplog.records) == 2


def test_a_held_out_score_reaches_the_coordinator_which_judges_divergence_by_it(bob, own_redis):
    """A score past chance's is a divergence (engine.recipe.divergence): the job's coordinator must read it."""
    from tests.webapp.test_sockets import enrolled, running_job
    from webapp.jobs.ingest import record_events

    device, _ = enrolled()
    job = running_job(bob, [device])
    reader = eventstream.Reader(job.pk)
    score = {"type": "eval", "iteration": 1, "loss": 54.3, "accuracy": None, "perplexity": None, "samples": 64,
             "device_s": 0.1, "generation": 0}  # fmt: skip
    record_events(device, [{"seq": 1, "job": job.pk, "event": score}])
    got = []
    for _ in range(10):
        got += [e for _, _, e in reader.read(0.5)]
        if got:
            break
    assert [e["type"] for e in got] == ["eval"]
