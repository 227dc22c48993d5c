"""The site's sockets when its Redis dies (webapp/lib/outage.py): agents and pages are closed with a code they connect
again on, after one warning per outage and no traceback; an agent connecting meanwhile is not told it is refused."""

import logging

import pytest
from asgiref.sync import async_to_sync

from tests.webapp.conftest import kill
from tests.webapp.test_sockets import HELLO, agent_socket, enrolled, running_job, say, watching
from webapp.lib.outage import SocketOutage

pytestmark = pytest.mark.django_db(transaction=True)


def closed_for_a_reconnect(output: dict) -> bool:
    return output == {"type": "websocket.close", "code": SocketOutage.CLOSED}


def only_warnings(caplog, count: int) -> list[str]:
    """The site's log: `count` warnings, each saying what cannot be reached, and nothing worse."""
    records = [r for r in caplog.records if r.name.startswith("webapp")]
    assert not [r.getMessage() for r in records if r.levelno > logging.WARNING]
    said = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(said) == count and all(s.startswith("cannot reach ") for s in said), said
    return said


def test_sockets_are_closed_to_connect_again_when_redis_dies(own_redis, bob, caplog):
    caplog.set_level(logging.INFO)
    device, credential = enrolled()
    job = running_job(bob, [device])

    async def run():
        agent = agent_socket(credential)
        assert (await agent.connect())[0]
        assert (await say(agent, HELLO))["type"] == "welcome"
        browser = await watching(bob, job)
        assert (await browser.receive_json_from(5))["type"] == "snapshot"
        kill(own_redis)
        # its time cannot be noted in Redis now (the database notes it)
        await agent.send_json_to({"type": "heartbeat", "state": "idle", "job": None})
        assert closed_for_a_reconnect(await agent.receive_output(10))
        assert closed_for_a_reconnect(await browser.receive_output(10))

    async_to_sync(run)()
    said = only_warnings(caplog, 2)  # one for the channel layer (both sockets), one for the heartbeat's time
    assert sum("channel layer" in s for s in said) == 1


def test_an_agent_connecting_while_redis_is_down_is_told_to_come_back_not_refused(own_redis, caplog):
    caplog.set_level(logging.INFO)
    _, credential = enrolled()
    kill(own_redis)

    async def run():
        agent = agent_socket(credential)
        assert (await agent.connect())[0]  # accepted (a refusal would be HTTP 403: an agent gives up on that)
        assert closed_for_a_reconnect(await agent.receive_output(10))

    async_to_sync(run)()
    only_warnings(caplog, 1)


def test_a_coordinator_starting_while_redis_is_down_leaves_its_job_waiting_not_failed(own_redis, bob, caplog):
    from webapp.jobs.coordinating import coordinate
    from webapp.jobs.models import Job

    caplog.set_level(logging.INFO)
    a, _ = enrolled("tx2-0")
    job = running_job(bob, [a])
    kill(own_redis)
    assert coordinate(job.pk) == "stopped"  # its lease is given up: the next watch starts it again
    assert coordinate(job.pk) == "stopped"
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert "Redis" in only_warnings(caplog, 1)[0]  # one line for the outage, not one per try
