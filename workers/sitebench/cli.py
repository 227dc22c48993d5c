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


def _positive_float(high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(f"must be above 0 and at most {high:g}, got {text}")
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
    live.add_argument("--rate", type=_positive_float(MAX_RATE), default=100.0, help="events per second (default 100)")
    live.add_argument("--seconds", type=_positive_float(MAX_SECONDS), default=60.0, help="sending time (default 60)")
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
    return args
