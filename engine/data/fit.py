"""Which zoo models a dataset fits: the checks behind the datasets' one-line errors."""

from __future__ import annotations

from engine.errors import UserError
from engine.models import ModelSpec, get_model, model_names

BYTES = 256  # byte-level text: tokens and next-token classes are 0..255


def is_image_model(spec: ModelSpec) -> bool:
    return spec.input_dtype == "float32" and len(spec.input_shape) == 3


def image_models(min_classes: int) -> list[str]:
    """Zoo image models with at least `min_classes` outputs."""
    return [n for n in model_names() if is_image_model(s := get_model(n)) and s.num_classes >= min_classes]


def require_image_model(dataset: str, spec: ModelSpec, min_classes: int) -> None:
    """UserError unless `spec` takes images and has at least `min_classes` outputs."""
    if not is_image_model(spec) or spec.num_classes < min_classes:
        fits = image_models(min_classes)
        raise UserError(
            f"dataset {dataset!r} needs an image model with at least {min_classes} classes; {spec.name!r} takes "
            f"{spec.input_dtype} {spec.input_shape} with {spec.num_classes} classes: "
            + (f"use {', '.join(fits)}" if fits else "no model in the zoo has that many")
        )


def fits_bytes(spec: ModelSpec) -> bool:
    """Whether `spec` predicts the next token of text: bytes, or its own tokenizer's ids."""
    if spec.tokenizer:
        from engine.data.text import load_tokenizer

        size = len(load_tokenizer(spec.tokenizer))
        return spec.task == "language-modeling" and spec.vocab_size >= size and spec.num_classes >= size
    return spec.task == "language-modeling" and spec.vocab_size >= BYTES and spec.num_classes >= BYTES


def byte_language_models() -> list[str]:
    return [n for n in model_names() if fits_bytes(get_model(n))]


def require_byte_language_model(dataset: str, spec: ModelSpec) -> None:
    """UserError unless `spec` is a language model whose vocabulary holds every byte."""
    if not fits_bytes(spec) and spec.tokenizer:
        from engine.data.text import load_tokenizer

        tokens = len(load_tokenizer(spec.tokenizer))
        raise UserError(
            f"dataset {dataset!r} is next-token text in the ids of {spec.tokenizer}'s tokenizer ({tokens} tokens); "
            f"the model's vocabulary is {spec.vocab_size}: the folder's config and tokenizer do not agree"
        )
    if not fits_bytes(spec):
        raise UserError(
            f"dataset {dataset!r} is byte-level next-token text for a language model with a vocabulary of at least "
            f"{BYTES}; {spec.name!r} is a {spec.task} model with vocabulary {spec.vocab_size}: "
            f"use {', '.join(byte_language_models())}"
        )
