"""What every event of the catalogue (engine/events.py) is: a frozen dataclass with its message form, checked."""

from __future__ import annotations

import copy
from dataclasses import fields
from functools import cache
from typing import Any, ClassVar

from engine.errors import UserError
from engine.fields import schema, wrong


class EventError(UserError):
    """A malformed event; the text says which field and why."""


class Event:
    """Base of the catalogue's dataclasses: the message form and its checked inverse."""

    TYPE: ClassVar[str]
    SENT_BY: ClassVar[str] = "device"  # a device process (its agent relays it), "agent", "coordinator", "launcher"
    LOG: ClassVar[str | None] = None  # the level the site logs its line at (info, warning, error); None: not logged
    CHANGE: ClassVar[bool] = False  # a change of the run's devices or plan (fault tolerance): kept in its record
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ()  # numeric fields that may not be below zero
    FRACTIONS: ClassVar[tuple[str, ...]] = ()  # numeric fields between 0 and 1
    UNSAID: ClassVar[tuple[str, ...]] = ()  # fields left out of the message while they hold their default

    def to_message(self) -> dict:
        """The event as a message of the event stream: `"type"` plus its fields."""
        message = {"type": self.TYPE}
        for name, default in _defaults(type(self)):  # (asdict's deep copy of every field cost the site a tenth
            value = getattr(self, name)  # of its CPU at 3,000 events a second: only containers are copied)
            if name in self.UNSAID and value == default:
                continue
            message[name] = copy.deepcopy(value) if isinstance(value, (dict, list, tuple)) else value
        return message

    def level(self) -> str | None:
        """The level the site's job log says its `line()` at (info, warning, error); None: not in the log."""
        return self.LOG

    def line(self) -> str | None:
        """The one sentence the CLI prints and, at `level()`, the site's job log shows for it; None: none."""
        return None

    def mark(self) -> dict | None:
        """Where the live page's throughput chart marks it, `{"x": iteration, "text", "tone"}` (tone: bad,
        good, warn or info); None: it is not marked."""
        return None

    @classmethod
    def from_message(cls, doc: Any) -> Any:
        """The event in `doc`, checked; fields outside the catalogue are dropped."""
        if not isinstance(doc, dict):
            raise EventError(f"an event must be an object, got {type(doc).__name__}")
        if doc.get("type", cls.TYPE) != cls.TYPE:
            raise EventError(f"expected a {cls.TYPE!r} event, got {doc.get('type')!r}")
        values = {}
        for name, (types, required) in schema(cls).items():
            if name not in doc:
                if required:
                    raise EventError(f"{cls.TYPE}: missing field {name!r}")
                continue
            value = doc[name]
            why = wrong(value, types)
            if why:
                raise EventError(f"{cls.TYPE}: field {name!r} {why}")
            if name in cls.NON_NEGATIVE and value is not None and value < 0:
                raise EventError(f"{cls.TYPE}: field {name!r} must not be negative")
            if name in cls.FRACTIONS and value is not None and not 0 <= value <= 1:
                raise EventError(f"{cls.TYPE}: field {name!r} must be between 0 and 1")
            values[name] = float(value) if float in types and type(value) is int else value
        return cls(**values)


@cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each of an event class's fields, in order."""
    return tuple((f.name, f.default) for f in fields(cls))
