"""The benchmark's command line: its arguments, checked, and each mistake reported as one line."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

from engine.errors import OneLineParser
from workers.sitebench import (
    BATCH_SIZE,
    GRACE_S,
    ITERATIONS,
    MAX_BATCH,
    MAX_DELIVERIES,
    MAX_RATE,
    MAX_SECONDS,
    MAX_SUBSCRIBERS,
    MODEL,
    WINDOW_S,
)

PROG = "python -m workers.sitebench"
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def _number(high: float, zero: bool = False):
    """A finite number above 0 (from 0 with `zero`) and at most `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (0 <= value if zero else 0 < value) and value <= high):
            bounds = f"from 0 to {high:g}" if zero else f"above 0 and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


def local_url(text: str) -> str:
    """The site's base URL: http(s) on 127.0.0.1 or localhost only (this is a load generator)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL like http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL like http://127.0.0.1:8000")
    if parts.hostname not in LOCAL_HOSTS:
        raise argparse.ArgumentTypeError(
            f"only a site on 127.0.0.1 or localhost may be benchmarked, got {parts.hostname}"
        )
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} has a query or fragment; give the site's base URL")
    netloc = parts.hostname + (f":{port}" if port else "")
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def device_name(text: str) -> str:
    if not text or len(text) > 64 or not all(c.isalnum() or c in "-_." for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name (1-64 letters, digits, '-', '_', '.')")
    return text


EPILOG = f"""\
what it does (nothing but the site's public API and sockets):
  a token from `manage.py createtoken USER` (run here, with this environment: set the same
  ASTEROID_VAR_DIR / DATABASE_URL as the site) unless --token; a device DEVICE registered (or given a new
  enrollment token) and enrolled; an agent on /ws/agent/ (the real agent's connection and outbox, running no
  device process); a job of {MODEL}, batch {BATCH_SIZE}, {ITERATIONS} iterations on that device alone, planned
  and launched; SUBSCRIBERS sockets on /ws/jobs/<id>/; RATE iteration events per second for SECONDS, added to
  the agent's outbox BATCH at a time (the agent's connection sends what has accumulated); then the job is
  cancelled. Latency starts when an event is added to the outbox. An event not received {GRACE_S:g} s after
  the last send is lost. Latencies are in ms; the p99 of the first and last {WINDOW_S:g} s (half the run when
  shorter) shows whether delays grow.

example:
  ASTEROID_PORT=18555 ASTEROID_CLUSTER=none .venv/bin/python -m webapp.startsite &
  .venv/bin/python -m workers.sitebench live --url http://127.0.0.1:18555 --subscribers 20 --rate 100 --seconds 60
"""


CONTROL_EPILOG = """\
examples:
  .venv/bin/python -m workers.sitebench control --agents 500 --jobs 50 --browsers 100 --seconds 60 --kill-after 30
  .venv/bin/python -m workers.sitebench control --daphnes 2 --coordinators 2 --celery 2 \\
      --database-url postgres://postgres@127.0.0.1:5432/bench --redis-url redis://127.0.0.1:6379/0 --kill-after 30

The site under test runs in a new directory under /tmp (its log: site.log there), on free ports, with no
emulated agents; the boards are named bench-000, bench-001, ...; its jobs train mobilenetv2 (--batch-size, default 32).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Benchmarks of a running Asteroid site.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    live = sub.add_parser(
        "live",
        help="latency of live events: agent -> site -> N subscribers of one job",
        description="Latency of live events from a device agent, through the site, to N sockets watching its job.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    live.add_argument("--url", required=True, type=local_url, help="the site, e.g. http://127.0.0.1:8000 (local only)")
    live.add_argument("--token", help="a staff member's API token (default: a new one from manage.py createtoken)")
    live.add_argument("--user", default="admin", help="staff account for manage.py createtoken (default: admin)")
    live.add_argument(
        "--subscribers", type=_int_in(1, MAX_SUBSCRIBERS), default=20, help="sockets on the job (default 20)"
    )
    live.add_argument("--rate", type=_number(MAX_RATE), default=100.0, help="events per second (default 100)")
    live.add_argument("--seconds", type=_number(MAX_SECONDS), default=60.0, help="sending time (default 60)")
    live.add_argument(
        "--batch",
        type=_int_in(1, MAX_BATCH),
        default=1,
        help=f"events added to the agent's outbox at once, every BATCH/RATE s (default 1, at most {MAX_BATCH})",
    )
    live.add_argument(
        "--device", type=device_name, default="bench-live", help="the benchmark's device (default bench-live)"
    )
    live.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    live.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    control = sub.add_parser(
        "control",
        help="the control plane at scale: a site of its own, many boards, jobs and browsers, and processes killed",
        description="Start a site of its own (embedded SQLite and Redis, or --database-url / --redis-url), with "
        "--daphnes, --coordinators and --celery processes; enroll --agents boards (the real agent's session each, "
        "heartbeating); run --jobs jobs of --job-devices boards each, whose devices send what a training run sends "
        "(its steps and iterations) at the rate its plan predicts; watch them with --browsers sockets; kill a "
        "coordinators and a daphne process (--kill) after --kill-after s. Reports latencies, what was lost, job "
        "restarts, rows and bytes per job-hour (before and after compaction) and CPU per process.",
        epilog=CONTROL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    control.add_argument("--agents", type=_int_in(1, 2000), default=500, help="boards (default 500)")
    control.add_argument("--jobs", type=_int_in(1, 500), default=50, help="concurrent jobs (default 50)")
    control.add_argument("--job-devices", type=_int_in(1, 16), default=2, help="boards per job (default 2)")
    control.add_argument("--browsers", type=_int_in(1, MAX_SUBSCRIBERS), default=100,
                         help="browser sockets, spread over the jobs (default 100)")  # fmt: skip
    control.add_argument("--seconds", type=_number(MAX_SECONDS), default=60.0, help="streaming time (default 60)")
    control.add_argument("--batch-size", type=_int_in(1, 4096), default=32,
                         help="the jobs' batch (default 32): with the plan, it sets how fast they iterate")  # fmt: skip
    control.add_argument("--drain", type=_number(MAX_SECONDS), default=300.0,
                         help="after streaming, how long to wait for the site to store what the boards hold "
                         "(default 300 s); what is still held then counts as lost")  # fmt: skip
    control.add_argument("--kill-after", type=_number(MAX_SECONDS, zero=True), default=0.0,
                         help="kill a coordinators and a daphne process this many s in (default 0: none)")  # fmt: skip
    control.add_argument("--kill", choices=("both", "coordinators", "daphne"), default="both",
                         help="which processes --kill-after kills: a coordinators and a daphne process (both, the "
                              "default), or one of them")  # fmt: skip
    control.add_argument("--daphnes", type=_int_in(1, 16), default=1, help="daphne processes (default 1)")
    control.add_argument("--coordinators", type=_int_in(1, 16), default=1,
                         help="coordinators processes (default 1; more need --database-url)")  # fmt: skip
    control.add_argument("--celery", type=_int_in(1, 16), default=1, help="Celery workers (default 1)")
    control.add_argument("--database-url", default="", help="PostgreSQL for the site (default: its own SQLite)")
    control.add_argument("--redis-url", default="", help="Redis for the site (default: its own embedded one)")
    control.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    control.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments; a mistake exits with one line (status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(message: str):
        parser.exit(2, f"{parser.prog} {args.command}: error: {message} (see --help)\n")

    if args.command == "live":
        events = round(args.rate * args.seconds)
        if events < 1:
            fail(f"--rate {args.rate:g} for --seconds {args.seconds:g} sends no event; send at least one")
        if events * args.subscribers > MAX_DELIVERIES:
            fail(
                f"{events} events to {args.subscribers} subscribers is over {MAX_DELIVERIES} deliveries; "
                "lower --rate, --seconds or --subscribers"
            )
        if args.token is not None and not args.token.strip():
            fail("--token is empty")
    if args.command == "control":
        if args.jobs * args.job_devices > args.agents:
            fail(f"{args.jobs} jobs of {args.job_devices} boards need {args.jobs * args.job_devices} boards; "
                 f"--agents is {args.agents}")  # fmt: skip
        if args.kill_after and args.kill_after >= args.seconds:
            fail(f"--kill-after {args.kill_after:g} is not within the --seconds {args.seconds:g} of streaming")
        if args.coordinators > 1 and not args.database_url.startswith(("postgres://", "postgresql://")):
            fail("more than one coordinators process needs PostgreSQL: give --database-url postgres://...")
        if args.redis_url and not args.redis_url.startswith(("redis://", "rediss://")):
            fail(f"--redis-url {args.redis_url!r} is not a redis:// URL")
    return args
