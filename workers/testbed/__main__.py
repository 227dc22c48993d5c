"""`python -m workers.testbed`: build, inspect, fault and remove a LAN of namespaced boards (see docs/testbed.md)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine.errors import ErrorFirstParser
from workers.testbed import Testbed, TestbedError
from workers.testbed.net import remove


def pairs(values: list[str], what: str, convert=str) -> dict:
    """['b1=5mbit', ...] as {'b1': '5mbit', ...}."""
    out = {}
    for value in values:
        board, sep, rest = value.partition("=")
        try:
            if not sep:
                raise ValueError
            out[board] = convert(rest)
        except ValueError:
            raise TestbedError(f"bad {what} {value!r}: write BOARD=VALUE, e.g. b1=5mbit or b1=86400") from None
    return out


def parser() -> ErrorFirstParser:
    common = ErrorFirstParser(add_help=False)
    common.add_argument("--name", default="ast", help="the testbed's name, the prefix of its objects (default ast)")
    p = ErrorFirstParser(
        prog="python -m workers.testbed", description="A LAN of namespaced boards with faults from the world."
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    up = sub.add_parser("up", parents=[common], help="build the testbed (after removing any leftovers of it)")
    up.add_argument("--boards", type=int, default=4)
    up.add_argument("--subnet", default="198.18.42.0/24")
    up.add_argument("--rate", default="20mbit", help="every link's rate, e.g. 20mbit, 1gbit, none")
    up.add_argument("--rate-of", action="append", default=[], metavar="BOARD=RATE", help="one board's link rate")
    up.add_argument("--offset", action="append", default=[], metavar="BOARD=SECONDS", help="a board's clock offset")
    status = sub.add_parser("status", parents=[common], help="boards, addresses, rates, clocks, link/freezer/cpu")
    status.add_argument("--json", action="store_true")
    sub.add_parser("down", parents=[common], help="kill the boards' processes and remove everything")
    sub.add_parser("bench", help="a lab of three boards on a testbed of its own, measured (docs/benchmarks.md)")
    run = sub.add_parser("run", parents=[common], help="run CMD on BOARD in the foreground: run BOARD -- CMD ...")
    run.add_argument("board")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    for verb, text in [
        ("unplug", "pull the board's cable"),
        ("plug", "put it back"),
        ("freeze", "stop every process on the board"),
        ("thaw", "let them go on"),
        ("unthrottle", "lift the CPU limit"),
    ]:
        sub.add_parser(verb, parents=[common], help=text).add_argument("board")
    for verb, arg, kind, text in [
        ("flap", "seconds", float, "unplug, wait SECONDS, plug"),
        ("throttle", "percent", float, "limit the board to PERCENT of one core"),
        ("shape", "rate", str, "change the board's link rate (e.g. 5mbit, none)"),
        ("saturate", "seconds", float, "fill the board's uplink for SECONDS"),
    ]:
        cmd = sub.add_parser(verb, parents=[common], help=text)
        cmd.add_argument("board")
        cmd.add_argument(arg, type=kind)
    return p


def table(tb: Testbed, live: bool) -> str:
    rows = [["board", "address", "rate", "clock offset"] + (["link", "frozen", "cpu", "pids"] if live else [])]
    for b in tb.status()["boards"]:
        days, rest = divmod(b["clock_offset_s"], 86400)
        row = [b["name"], b["address"], b["rate"] or "none", f"+{b['clock_offset_s']} s ({days}d {rest / 3600:.1f}h)"]
        if live:
            cpu = f"{b['cpu_quota_percent']}%" if b["cpu_quota_percent"] is not None else "-"
            row += [b["link"], "yes" if b["frozen"] else "no", cpu, str(len(b["pids"]))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([*lines, f"site address {tb.site_address} (on {tb.bridge}, subnet {tb.subnet})"])


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a CI timeout, systemd) ends the command as Ctrl-C does: a KeyboardInterrupt, so every
    `finally` runs and what was built (namespaces, bridge, state file, the boards' processes) is torn down. A
    second SIGTERM during that teardown is ignored, so it cannot cut the teardown short."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; a caller elsewhere keeps its own
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        with sigterm_as_interrupt():
            if argv[:1] == ["bench"]:  # a lab on a testbed of its own, measured (workers/testbed/bench.py)
                from workers.testbed.bench import main as bench

                return bench(argv[1:])
            return dispatch(parser().parse_args(argv))
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def dispatch(args) -> int:
    if args.verb == "up":
        tb = Testbed(
            name=args.name,
            boards=args.boards,
            subnet=args.subnet,
            rate=args.rate,
            rates=pairs(args.rate_of, "--rate-of"),
            clock_offsets=pairs(args.offset, "--offset", int),
        )
        tb.up()
        print(table(tb, live=False))
        return 0
    if args.verb == "down":
        remove(args.name)
        print(f"testbed {args.name} removed")
        return 0
    tb = Testbed.load(args.name)
    if args.verb == "status":
        print(json.dumps(tb.status(), indent=1) if args.json else table(tb, live=True))
        return 0
    if args.verb == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise TestbedError("nothing to run: write run BOARD -- CMD ...")
        code = tb.board(args.board).run(cmd).returncode
        return code if code >= 0 else 128 - code
    if args.verb == "saturate":
        handle = tb.saturate(args.board, args.seconds)
        try:
            got = handle.wait()
        finally:
            handle.stop()
        print(f"{args.board} sent {got / 1e6:.1f} MB in {args.seconds:g} s ({8 * got / args.seconds / 1e6:.1f} Mbit/s)")
        return 0
    verb = getattr(tb, args.verb)
    extra = [getattr(args, a) for a in ("seconds", "percent", "rate") if hasattr(args, a)]
    verb(args.board, *extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
