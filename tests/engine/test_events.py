"""The event catalogue: messages round-trip, and a bad field is one clear error naming it."""

import pytest

from engine.events import Eval, EventError, parse

GOOD = {"type": "eval", "iteration": 4, "loss": 0.7, "accuracy": 0.81, "perplexity": None, "samples": 352,
        "device_s": 2.1}  # fmt: skip


def test_an_eval_event_round_trips():
    ev = parse(GOOD)
    assert isinstance(ev, Eval) and ev.to_message() == {**GOOD, "generation": 0}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("accuracy", 1.5, "field 'accuracy' must be between 0 and 1"),
        ("accuracy", -0.1, "field 'accuracy' must be between 0 and 1"),
        ("samples", -1, "field 'samples' must not be negative"),
        ("perplexity", -2.0, "field 'perplexity' must not be negative"),
        ("accuracy", "x", "field 'accuracy' has the wrong type"),
    ],
)
def test_a_bad_eval_field_is_named(field, value, message):
    with pytest.raises(EventError, match=message):
        parse({**GOOD, field: value})
