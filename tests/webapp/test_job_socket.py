"""The job socket `/ws/jobs/<id>/` (webapp/jobs/consumers.py): every iteration the job stores reaches it, in order,
even those the channel layer dropped on their way."""

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from tests.webapp.test_sockets import enrolled, running_job, watching
from webapp.jobs.models import Job, JobEvent

pytestmark = pytest.mark.django_db(transaction=True)


def iteration(n: int, loss: float = 2.0) -> dict:
    return {"type": "iteration", "iteration": n, "loss": loss, "iteration_s": 0.08, "throughput": 100.0,
            "late_steps": 0, "steps": 2, "time": 0.08 * (n + 1)}  # fmt: skip


def store(job: Job, *numbers: int, loss: float = 2.0) -> None:
    """Iterations the site stored (as from the job's device)."""
    for n in numbers:
        JobEvent.objects.create(job=job, device="tx2-0", type="iteration", data=iteration(n, loss))


async def relay(job: Job, message: dict) -> None:
    """What the site sends the job's watchers."""
    from channels.layers import get_channel_layer

    await get_channel_layer().group_send(f"job.{job.pk}", {"type": "job.message", "message": message})


def test_a_job_socket_sends_the_iterations_the_channel_layer_dropped_before_the_next_one(bob):
    """channels_redis drops what it is sent for a socket whose channel is full or whose messages expired; the socket
    notices the gap in the iteration numbers and reads the missing ones back from the database, in order."""
    device, _ = enrolled()
    job = running_job(bob, [device])
    store(job, 0, 1)

    async def run():
        async def received() -> list[tuple[int, float]]:
            msg = await browser.receive_json_from(5)
            inner = msg["messages"] if msg["type"] == "batch" else [msg]
            return [(m["iteration"], m["loss"]) for m in inner]

        browser = await watching(bob, job)
        assert [m["iteration"] for m in (await browser.receive_json_from(5))["iterations"]] == [0, 1]
        await sync_to_async(store)(job, 2, 3, 4, 5, 6)
        await relay(job, iteration(2))
        assert await received() == [(2, 2.0)]
        await relay(job, iteration(5))  # 3 and 4 were stored, and dropped on their way
        assert await received() == [(3, 2.0), (4, 2.0)]
        assert await received() == [(5, 2.0)]
        await relay(job, iteration(6))
        assert await received() == [(6, 2.0)]
        # A rollback replays from 4: no gap, and a gap in the replay is filled with the replayed iterations.
        await sync_to_async(store)(job, 4, 5, 6, loss=1.5)
        await relay(job, iteration(4, 1.5))
        assert await received() == [(4, 1.5)]
        await relay(job, iteration(6, 1.5))
        assert await received() == [(5, 1.5)]
        assert await received() == [(6, 1.5)]
        assert await browser.receive_nothing(0.3)
        await browser.disconnect()

    async_to_sync(run)()


def test_a_job_socket_told_the_job_ended_sends_the_last_iterations_if_they_were_dropped(bob):
    device, _ = enrolled()
    job = running_job(bob, [device])
    store(job, 0, 1, 2)

    async def run():
        browser = await watching(bob, job)
        assert [m["iteration"] for m in (await browser.receive_json_from(5))["iterations"]] == [0, 1, 2]
        await sync_to_async(store)(job, 3)  # stored; its relay dropped
        running = {"type": "status", "status": "running", "progress": 0.9, "message": ""}
        await relay(job, running)
        assert (await browser.receive_json_from(5)) == running  # not an end: nothing read back
        done = {"type": "status", "status": "completed", "progress": 1.0, "message": ""}
        await relay(job, done)
        assert [m["iteration"] for m in (await browser.receive_json_from(5))["messages"]] == [3]
        assert (await browser.receive_json_from(5)) == done
        await browser.disconnect()

    async_to_sync(run)()
