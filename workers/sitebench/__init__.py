"""Load benchmarks of a site: `python -m workers.sitebench live --url http://HOST:PORT` (a running site, from the
outside) and `python -m workers.sitebench control` (a site of its own at a lab's scale: many boards, jobs and
browsers, processes killed mid-run; control.py, docs/benchmarks.md "The control plane at scale").

`live` measures how long an agent's event takes to reach the browsers watching its job: agent -> /ws/agent/ ->
the site stores and applies it -> the job's Channels group -> /ws/jobs/<id>/ -> every subscriber. Everything is
real and goes through the site's public means only:

1. an API token (`manage.py createtoken USER`, run with this environment, or --token);
2. a device (`POST /api/devices/`, or a new enrollment token for an existing one: `POST /api/devices/<id>/token/`),
   enrolled like a board (workers/enroll.py) for a device credential;
3. an agent on `/ws/agent/`: the real agent's session (workers/connection.py `Connection`, with its
   workers/outbox.py `Outbox`: hello, heartbeats, clock probes, acks, resends after a reconnect) driving a
   runner of the benchmark's own that accepts its one job without starting any device process (agent.py);
4. a job on that device only (`POST /api/jobs/`, planned by the site's Celery worker, `POST .../launch/`);
5. N subscribers on `/ws/jobs/<id>/` with the API token, in a second process so that receiving does not delay
   sending; each notes when every `iteration` arrives (alone, or inside a `{"type": "batch"}` message);
6. the benchmark adds the catalogue's `iteration` events (engine/events.py) to the agent's outbox at --rate per
   second, --batch at a time, open loop (on a fixed schedule whatever the site does); the connection sends
   them as a real agent sends its device processes' events;
7. the job is cancelled at the end (nothing else is removed: the device stays registered for the next run).

Latency = receive time - the time the event was added to the outbox, both time.monotonic() on this host
(system-wide on Linux): what the agent's own batching and sending add is part of it. An event a subscriber has
not received GRACE_S (5 s) after the last send is lost.
"""

GRACE_S = 5.0  # after the last send, how long subscribers may still receive before an event counts as lost
WINDOW_S = 10.0  # the first and last windows whose p99 shows growth
MAX_BATCH = 200  # events added to the outbox at once: at most one `events` message (docs/protocol.md)
MAX_SUBSCRIBERS = 1000
MAX_RATE = 10_000.0
MAX_SECONDS = 3600.0
MAX_DELIVERIES = 20_000_000  # subscribers x events: what the receive records may hold

# The job the events belong to: one Xavier NX, a small model and batch (it must plan and fit), many iterations
# (the site's maximum) so that progress is not capped during long runs.
DEVICE_KIND = "jetson-xavier-nx"
MODEL, BATCH_SIZE, ITERATIONS = "mobilenetv2", 8, 100_000

HTTP_TIMEOUT_S = 30.0
TOKEN_TIMEOUT_S = 120.0  # manage.py createtoken (imports Django)
CONNECT_TIMEOUT_S = 15.0
PLAN_TIMEOUT_S = 300.0  # the first plan of a model profiles it on the site's host
START_TIMEOUT_S = 60.0  # launch -> assign -> accepted -> start
SUBSCRIBE_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
MAX_FRAME = 64 * 1024 * 1024


class BenchError(Exception):
    """Something that stops the benchmark; printed as one line."""
