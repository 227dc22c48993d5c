"""The agent messages the site accepts (docs/protocol.md), checked field by field: `parse` or ProtocolError.

JSON is read strictly: no NaN or Infinity, integers of at most 19 digits, bounded nesting. The events inside an
`events` message are checked by the engine's event catalogue (engine/events.py) and replaced by what it keeps:
the catalogue's fields, nothing else. A malformed event does not spoil its batch: it moves to the message's
`rejected` list (seq, why), so the site acknowledges it without storing it and the agent's stream goes on.
"""

from __future__ import annotations

import json
import math

from engine import events as catalogue
from engine.fields import MAX_INT

MAX_BATCH = 200
MAX_DIGITS = 19  # an integer of more digits cannot be a count, a seq or an id (the database's bigint)


class ProtocolError(ValueError):
    """A malformed message; the text says which field and why."""


def _field(msg: dict, name: str, types, optional: bool = False):
    if name not in msg or msg[name] is None:
        if optional:
            return None
        raise ProtocolError(f"{msg.get('type', 'message')}: missing field {name!r}")
    value = msg[name]
    if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
        raise ProtocolError(f"{msg.get('type')}: field {name!r} has the wrong type ({type(value).__name__})")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ProtocolError(f"{msg.get('type')}: field {name!r} is out of range")
    return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _number(msg: dict, name: str, optional: bool = False):
    value = _field(msg, name, (int, float), optional)
    if value is not None and value < 0:
        raise ProtocolError(f"{msg.get('type')}: field {name!r} must not be negative")
    return value


def _hello(msg: dict) -> None:
    _field(msg, "session", str)
    if not 1 <= len(msg["session"]) <= 64:
        raise ProtocolError("hello: session must be 1 to 64 characters")
    _field(msg, "kind", str)
    _field(msg, "emulated", bool)
    for name in ("memory_bytes", "gflops", "host_gflops"):
        _number(msg, name, optional=name == "host_gflops")
    link = _number(msg, "link_mbps", optional=True)  # its link to the site, measured (workers.linkprobe)
    if link is not None and not 0 < link < 1e9:
        raise ProtocolError("hello: link_mbps must be a positive number of Mbps")
    address = _field(msg, "address", str, optional=True)
    if address is not None and len(address) > 64:
        raise ProtocolError("hello: address is longer than 64 characters")
    compute = _field(msg, "compute", str, optional=True)  # where its device processes compute (its GPU, if any)
    if compute is not None and compute not in ("cpu", "cuda"):
        raise ProtocolError("hello: compute must be 'cpu' or 'cuda'")
    gpu = _field(msg, "gpu", str, optional=True)
    if gpu is not None and len(gpu) > 128:
        raise ProtocolError("hello: gpu (its name) is longer than 128 characters")
    _number(msg, "gpu_memory", optional=True)
    datasets = _field(msg, "datasets", list, optional=True)  # those it can serve (engine.data.datasets_here)
    if datasets is not None and (
        len(datasets) > 64 or not all(isinstance(d, str) and 0 < len(d) <= 64 for d in datasets)
    ):
        raise ProtocolError("hello: datasets must be a list of at most 64 dataset names")
    if msg.get("probe") is not None:
        from engine.devices import canonical_probe
        from engine.errors import UserError

        try:
            canonical_probe(msg["probe"], "hello: probe")
        except UserError as exc:
            raise ProtocolError(str(exc)) from None


# A heartbeat's health figures (workers.health) and their bounds; each is optional.
HEALTH = {"cpu": 100.0, "gpu": 100.0, "mem_used": 2.0**50, "mem_total": 2.0**50, "temp_c": 200.0,
          "gpu_temp_c": 200.0, "power_w": 10_000.0}  # fmt: skip


def _heartbeat(msg: dict) -> None:
    if _field(msg, "state", str) not in ("idle", "busy"):
        raise ProtocolError("heartbeat: state must be 'idle' or 'busy'")
    _field(msg, "job", int, optional=True)
    _number(msg, "pending", optional=True)  # events the agent holds that the site has not acknowledged
    health = _field(msg, "health", dict, optional=True)
    for name, value in (health or {}).items():
        if name not in HEALTH:
            raise ProtocolError(f"heartbeat: unknown health figure {str(name)[:40]!r}: {', '.join(HEALTH)}")
        low = -50.0 if name.endswith("temp_c") else 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= HEALTH[name]:
            raise ProtocolError(f"heartbeat: health figure {name!r} must be a number from {low:g} to {HEALTH[name]:g}")


def _accepted(msg: dict) -> None:
    _field(msg, "job", int)
    port = _field(msg, "port", int, optional=True)
    if port is not None and not 0 < port < 65536:
        raise ProtocolError(f"accepted: port {port} is not a TCP port")


def _events(msg: dict) -> None:
    items = _field(msg, "events", list)
    if not 1 <= len(items) <= MAX_BATCH:
        raise ProtocolError(f"events: send 1 to {MAX_BATCH} events per message, got {len(items)}")
    last = 0
    for item in items:
        if not isinstance(item, dict):
            raise ProtocolError("events: each item must be an object with seq, job and event")
        seq = _field(item, "seq", int)
        if seq <= last:
            raise ProtocolError("events: seq must increase within a message")
        last = seq
        _field(item, "job", int)
    good, rejected = [], []
    for item in items:
        try:
            # what devices and agents send (the catalogue says who sends what); a coordinator's or a launcher's
            # kinds, or an unknown one, are rejected with the reason and acknowledged
            item["event"] = catalogue.parse(item.get("event"), catalogue.sent_by("device", "agent")).to_message()
            good.append(item)
        except catalogue.EventError as exc:
            rejected.append((item["seq"], str(exc)))
    msg["events"], msg["rejected"], msg["last_seq"] = good, rejected, last


def _clock(msg: dict) -> None:
    t0 = _field(msg, "t0", (int, float))  # the agent's monotonic clock, echoed: any finite number
    if not math.isfinite(t0):
        raise ProtocolError("clock: field 't0' must be a finite number")


CHECKS = {"hello": _hello, "heartbeat": _heartbeat, "accepted": _accepted, "events": _events, "clock": _clock}


def parse(text: str | None, limit: int) -> dict:
    """The message in a text frame, checked; ProtocolError for anything else."""
    if text is None:
        raise ProtocolError("binary frames are not part of the protocol; send JSON text")
    if len(text) > limit:
        raise ProtocolError(f"message of {len(text)} bytes is over the limit of {limit}; send smaller batches")
    msg = strict_json(text)
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object with a 'type'")
    check = CHECKS.get(msg["type"]) if isinstance(msg.get("type"), str) else None
    if check is None:
        raise ProtocolError(f"unknown message type {str(msg.get('type'))[:40]!r}; expected one of {', '.join(CHECKS)}")
    check(msg)
    return msg


def strict_json(text: str):
    """JSON as the protocol allows it: finite numbers, integers of at most MAX_DIGITS digits, bounded nesting."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None


def _no_constant(name: str):
    raise ProtocolError(f"{name} is not a JSON number; send finite numbers (or null)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ProtocolError(f"an integer of {len(text.lstrip('-'))} digits is out of range (at most {MAX_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"{text[:20]} is not a finite number")
    return value
