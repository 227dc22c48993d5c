"""The registry of built-in models, looked up by name."""

from __future__ import annotations

from engine.errors import UserError
from engine.models import mobilenet, resnet, transformer, vgg
from engine.models.source import is_reference, user_model
from engine.models.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {s.name: s for m in (mobilenet, resnet, vgg, transformer) for s in m.specs()}


def model_names() -> list[str]:
    """Names of all built-in models, in registry order."""
    return list(MODELS)


def get_model(name: str) -> ModelSpec:
    """The spec of a built-in model, or of a module in a file (`PATH.py:FUNCTION@INPUT`, engine.models.source);
    a UserError listing the known names otherwise."""
    if is_reference(name):
        return user_model(name)
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(
            f"unknown model {name!r}; known models: {', '.join(MODELS)}, or your own as FILE.py:FUNCTION"
        ) from None
