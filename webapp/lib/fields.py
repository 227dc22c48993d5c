"""Form fields for bounded numbers: every error (not a number, infinite, too small, too big) names the range."""

from __future__ import annotations

from django import forms


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _messages(kind: str, lo: float, hi: float) -> dict[str, str]:
    line = f"Must be {kind} from {_show(lo)} to {_show(hi)}."
    # "invalid" covers text, NaN and ±inf (FloatField refuses non-finite values with it).
    return {"invalid": line, "min_value": line, "max_value": line}


def whole_number(lo: int, hi: int, **kwargs) -> forms.IntegerField:
    return forms.IntegerField(min_value=lo, max_value=hi, error_messages=_messages("a whole number", lo, hi), **kwargs)


def number(lo: float, hi: float, **kwargs) -> forms.FloatField:
    return forms.FloatField(min_value=lo, max_value=hi, error_messages=_messages("a number", lo, hi), **kwargs)
