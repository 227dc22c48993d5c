"""The one type check of plain-data messages: a dataclass's fields against their annotations (events, run options)."""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, fields
from typing import Any

MAX_INT = 2**63 - 1  # what a database's bigint column holds

_SCHEMAS: dict[type, dict[str, tuple[tuple[type, ...], bool]]] = {}
_UnionType = type(int | None)


def schema(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """{field: (accepted types, required)} from the dataclass's annotations (`float | None`: float or None)."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        found = {}
        for f in fields(cls):
            hint = hints[f.name]
            types = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
            required = f.default is MISSING and f.default_factory is MISSING
            found[f.name] = (tuple(typing.get_origin(t) or t for t in types), required)
        _SCHEMAS[cls] = found
    return _SCHEMAS[cls]


def wrong(value: Any, types: tuple[type, ...]) -> str | None:
    """Why `value` is not one of `types` (None when it is). A bool is no number; an int is a float; numbers
    are finite and fit a database's 64 bits."""
    if value is None and type(None) in types:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if bool in types:
        ok = isinstance(value, bool)
    elif int in types or float in types:
        ok = number and (float in types or isinstance(value, int))
        big = isinstance(value, int) and abs(value) > MAX_INT
        if ok and (big or isinstance(value, float) and not math.isfinite(value)):
            return f"must be a finite number within 64 bits, got {str(value)[:20]}"
    else:
        ok = isinstance(value, types)
    if not ok:
        expected = " or ".join(t.__name__ for t in types)
        return f"has the wrong type ({type(value).__name__}; expected {expected})"
    return None
