"""Hugging Face model folders (`--model hf:DIR`): `config.json`, and the weights when the folder has them, read
from the folder alone (nothing is ever downloaded); the model built with the Auto class of its task.

A folder whose `architectures` names a `...ForSequenceClassification` is a classifier over token ids; any other
a causal language model (next-token prediction). Its graph comes from `torch.export` (fx cannot follow the
library's Python), with the model in eval mode: the captured graph has no dropout, so a Hugging Face model
trains without it (the zoo's and a module file's dropout is kept, drawn per sample).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx, nn

from engine.errors import UserError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder only: the library never reaches for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def hf_builder(folder: Path) -> tuple[Callable[[], nn.Module], str]:
    """A function building the folder's model (its weights when it has them, else fresh under torch's seed), and
    its task ("classification" or "language-modeling")."""
    if not (folder / "config.json").is_file():
        raise UserError(f"hf:{folder} has no config.json: a Hugging Face model folder holds one")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
        from transformers.utils import logging

        logging.set_verbosity_error()  # the library's advice on configs goes to its log, not the user's terminal
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise UserError(f"hf:{folder}: cannot read config.json: {_first(exc)}") from None
    classify = any(a.endswith("ForSequenceClassification") for a in config.architectures or ())
    auto = AutoModelForSequenceClassification if classify else AutoModelForCausalLM
    config.use_cache = False  # training: no key/value cache
    pretrained = any((folder / name).is_file() for name in WEIGHTS)

    def build() -> nn.Module:
        try:
            if pretrained:
                return auto.from_pretrained(folder, config=config, local_files_only=True)
            return auto.from_config(config)
        except Exception as exc:  # an architecture of no supported task, a weights file of another model
            raise UserError(f"hf:{folder}: cannot build a {auto.__name__[9:]} model: {_first(exc)}") from None

    return build, "classification" if classify else "language-modeling"


def has_tokenizer(folder: Path) -> bool:
    """Whether the folder carries a tokenizer (then text datasets are its token ids, engine.data.text)."""
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def exporter(example: torch.Tensor) -> Callable[[nn.Module], fx.GraphModule]:
    """A tracer (engine.models.graph) by torch.export, the batch dimension dynamic, the model in eval mode."""

    def trace(module: nn.Module) -> fx.GraphModule:
        from torch.export import Dim, export

        was = module.training
        module.eval()
        try:
            program = export(module, (example,), dynamic_shapes=({0: Dim("batch")},), strict=False)
        except Exception as exc:
            raise UserError(f"cannot capture the model's graph with torch.export: {_first(exc)}") from None
        finally:
            module.train(was)
        gm = program.module()
        for n in list(gm.graph.nodes):  # the input's guards: each layer is run at its own share of the batch
            if n.op == "call_module" and n.target == "_guards_fn":
                gm.graph.erase_node(n)
        gm.recompile()
        return gm

    return trace


def save_folder(build: Callable[[], nn.Module], source: Path, state: dict, folder: Path) -> None:
    """The trained model as a Hugging Face folder that `from_pretrained` reads (with the source's tokenizer)."""
    import shutil

    model = build()
    model.load_state_dict(state, strict=True)
    try:
        model.save_pretrained(folder)
        for f in source.iterdir():  # the tokenizer and anything else the model comes with
            if f.is_file() and f.name not in (*WEIGHTS, "config.json") and not (folder / f.name).exists():
                shutil.copy2(f, folder / f.name)
    except OSError as exc:
        raise UserError(f"cannot write model folder {folder}: {exc.strerror or exc}") from None


def _first(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)[:200]
