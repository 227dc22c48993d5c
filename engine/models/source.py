"""Models named by reference: the zoo's names, a lab's own module (`PATH.py:FUNCTION@INPUT`) or a Hugging Face
model folder (`hf:DIR@text:N`, engine.models.hf).

    get_model("mobilenetv2")                                    # the zoo
    get_model("/lab/unet.py:build@image:3,64,64")               # FUNCTION() returns an nn.Module; images in
    get_model("/lab/lm.py:tiny_gpt@text:128")                    # token ids in (128 per sample)
    get_model("hf:/lab/gpt2-small@text:128")                     # config.json (+ weights) in the folder

`reference(...)` writes the canonical form (an absolute path) from what a user types: the CLI's `--model
unet.py:build --input-shape 3,64,64`. The reference is what plans, profiles and the boards carry: every process
that needs the model builds it from the file (the boards must be able to read the same path); the file's hash
names its profile cache, and `file_hash` lets a board refuse a file that is not the one planned for.
The module runs as the user wrote it: its task follows its output (`[N, K]`: K classes; token ids in and
`[N, T, V]` out: next-token prediction over V tokens).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from engine.errors import UserError
from engine.models.children import children_chain
from engine.models.graph import UntraceableError, capture, symbolic
from engine.models.randomness import Dropout
from engine.models.spec import ModelSpec

INPUTS = ("image", "text")
DEFAULT_SEQ = 128  # tokens per sample of a text model that says no more


@dataclass(frozen=True)
class Reference:
    path: Path  # the Python file, or the Hugging Face folder
    function: str  # "" for a Hugging Face folder
    input: str  # image or text
    shape: tuple[int, ...]  # per sample: C,H,W (or any) for images; (T,) for text
    digest: str = ""  # the SHA-256 the file (or folder) must have: a site pins what it registered

    @property
    def hf(self) -> bool:
        return not self.function

    def __str__(self) -> str:
        where = f"hf:{self.path}" if self.hf else f"{self.path}:{self.function}"
        pin = f"#sha256:{self.digest}" if self.digest else ""
        return f"{where}@{self.input}:{','.join(map(str, self.shape))}{pin}"


def is_reference(name: str) -> bool:
    """Whether `name` names a module in a file or a Hugging Face folder rather than a zoo model."""
    return name.startswith("hf:") or ".py:" in name


def parse_reference(name: str) -> Reference:
    """The parts of `PATH.py:FUNCTION@image:C,H,W`, `PATH.py:FUNCTION@text:T` or `hf:DIR@text:T`; a UserError
    says what is wrong. A `#sha256:HEX` at the end pins the file's content."""
    name, _, pin = name.partition("#sha256:")
    if pin and (len(pin) != 64 or any(c not in "0123456789abcdef" for c in pin)):
        raise UserError(f"model {name!r}: #sha256: must be followed by 64 hex digits")
    head, _, tail = name.partition("@")
    if head.startswith("hf:"):
        path, function = head[3:], ""
        if not path:
            raise UserError(f"model {name!r}: expected hf:DIR, a Hugging Face model folder")
    else:
        path, _, function = head.rpartition(":")
        if not path.endswith(".py") or not function.isidentifier():
            raise UserError(f"model {name!r}: expected PATH.py:FUNCTION, a Python file and a function in it")
    kind, _, dims = tail.partition(":")
    if kind not in INPUTS:
        raise UserError(f"model {name!r} needs its input: --input-shape C,H,W for images or --seq-len N for text")
    shape = shape_of(dims, "--seq-len" if kind == "text" else "--input-shape")
    if kind == "text" and len(shape) != 1:
        raise UserError(f"model {name!r}: a text input is one length (--seq-len N), got {dims!r}")
    if not function and kind != "text":
        raise UserError(f"model {name!r}: a Hugging Face model takes token ids: give --seq-len N")
    return Reference(Path(path), function, kind, shape, pin)


def shape_of(text: str, flag: str) -> tuple[int, ...]:
    """`3,32,32` as (3, 32, 32); a UserError naming `flag` otherwise."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape) or len(shape) > 4:
        raise UserError(f"{flag} must be up to four positive whole numbers separated by commas, got {text!r}")
    return shape


def pinned(model: str) -> str:
    """The canonical reference of `model` with the hash of its file (or folder) as it is now: what a site registers,
    so every board checks that it reads the same code."""
    ref = parse_reference(model)
    return str(replace(ref, digest=file_hash(ref.path)))


DATASET_INPUTS = {"cifar10": "image:3,32,32", "pytext": f"text:{DEFAULT_SEQ}", "text": f"text:{DEFAULT_SEQ}"}


def reference(model: str, input_shape: str | None = None, seq_len: int | None = None, dataset: str = "") -> str:
    """The canonical reference of what a user typed: a zoo name as it is; `FILE.py:FUNCTION` or `hf:DIR` with an
    absolute path and its input: `input_shape` "C,H,W" for images, else `seq_len` tokens for text, unless it says
    `@image:...` or `@text:...` itself; else what the `dataset` makes known (CIFAR-10's 3,32,32, text's 128
    tokens), or for a Hugging Face model its maximum positions."""
    if not is_reference(model):
        return model
    head, at, tail = model.partition("@")
    if head.startswith("hf:"):
        where = f"hf:{Path(head[3:]).expanduser().resolve()}"
    else:
        path, _, function = head.rpartition(":")
        where = f"{Path(path).expanduser().resolve()}:{function}"
    if input_shape and seq_len:
        raise UserError("give --input-shape (images) or --seq-len (text), not both")
    if not at:  # (a reference that says its input keeps it)
        if input_shape:
            tail = f"image:{','.join(map(str, shape_of(input_shape, '--input-shape')))}"
        elif seq_len:
            tail = f"text:{seq_len}"
        elif head.startswith("hf:"):
            tail = f"text:{_positions(Path(head[3:]).expanduser())}"
        elif dataset in DATASET_INPUTS:
            tail = DATASET_INPUTS[dataset]
        else:
            raise UserError(f"model {model}: give its input, --input-shape C,H,W for images or --seq-len N for text")
    return str(parse_reference(f"{where}@{tail}"))


def _positions(folder: Path) -> int:
    """A Hugging Face config's maximum sequence length, else DEFAULT_SEQ."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_SEQ  # (building the model says what is wrong with the folder)
    known = [config.get(k) for k in ("max_position_embeddings", "n_positions", "n_ctx")]
    return next((int(v) for v in known if isinstance(v, int) and v > 0), DEFAULT_SEQ)


def file_hash(path: Path) -> str:
    """The SHA-256 of a model file, or of a folder's files (names and contents, in name order), hex; a UserError
    when it cannot be read."""
    if not path.exists():
        raise UserError(f"model {'folder' if not path.suffix else 'file'} {path} does not exist")
    digest = hashlib.sha256()
    try:
        if path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(str(f.relative_to(path)).encode() + b"\0")
                digest.update(hashlib.sha256(f.read_bytes()).digest())
        else:
            digest.update(path.read_bytes())
    except OSError as exc:
        what = "folder" if path.is_dir() else "file"
        raise UserError(f"cannot read model {what} {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _builder(ref: Reference, digest: str):
    """FUNCTION from the file, loaded once per process and file content."""
    if not ref.path.is_file():
        raise UserError(f"model file {ref.path} does not exist")
    name = f"asteroid_user_model_{digest[:16]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ref.path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(ref.path.parent))  # the file's own helpers beside it import as they do for the lab
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise UserError(f"model file {ref.path} fails to load: {type(exc).__name__}: {_first(exc)}") from None
        finally:
            sys.path.remove(str(ref.path.parent))
        sys.modules[name] = module
    function = getattr(sys.modules[name], ref.function, None)
    if not callable(function):
        raise UserError(f"model file {ref.path} has no function {ref.function}")

    def build() -> nn.Module:
        try:
            module = function()
        except Exception as exc:
            raise UserError(f"{ref.function}() in {ref.path} raised {type(exc).__name__}: {_first(exc)}") from None
        if not isinstance(module, nn.Module):
            raise UserError(f"{ref.function}() in {ref.path} returned a {type(module).__name__}, not an nn.Module")
        return keyed_dropout(module)

    return build


def keyed_dropout(module: nn.Module) -> nn.Module:
    """`module` with each nn.Dropout replaced by the engine's, whose masks depend on the sample, not the process
    (so a replay or a re-plan draws the same ones)."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, child_name, Dropout(child.p))
    return module


def _first(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:200]


@functools.lru_cache(maxsize=16)
def _user_model(name: str, digest: str) -> ModelSpec:
    ref = parse_reference(name)
    if ref.hf:
        from engine.models.hf import exporter, has_tokenizer, hf_builder

        build, _ = hf_builder(ref.path)
    else:
        build = _builder(ref, digest)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # (a caller may be building on the meta device)
        torch.manual_seed(0)
        module = build()
        if ref.input == "text":
            vocab = _vocabulary(module)
            example = torch.randint(vocab, (2, *ref.shape))
        else:
            example = torch.randn((2, *ref.shape))
        try:
            chain = capture(module, example, exporter(example) if ref.hf else symbolic)
        except UntraceableError as exc:  # Python fx cannot follow: its children, if they form a chain
            chain = children_chain(module, example, exc)
        with torch.no_grad():
            module.eval()
            out = module(example)
    out = out[0] if isinstance(out, (tuple, list)) else out.get("logits") if isinstance(out, dict) else out
    raw = getattr(out, "logits", None)  # a Hugging Face ModelOutput
    out = raw if raw is not None else out
    task, classes = _task(ref, out)
    family, vocab = ("transformer", vocab) if ref.input == "text" else ("cnn", 0)

    def layers() -> list[nn.Module]:
        return chain.layers(build())

    return ModelSpec(
        name=name, family=family, task=task, input_shape=ref.shape,
        input_dtype="int64" if ref.input == "text" else "float32", num_classes=int(classes),
        description=f"{f'{ref.function}() from ' if ref.function else 'Hugging Face folder '}{ref.path.name}, "
        f"{len(chain.spans)} layers cut from its graph",
        factory=layers, vocab_size=int(vocab), chain=chain, digest=digest, build=build,
        tokenizer=str(ref.path) if ref.hf and has_tokenizer(ref.path) else "",
    )  # fmt: skip


def _task(ref: Reference, out) -> tuple[str, int]:
    """What the module's output for a batch of 2 says it does: [2, K] classifies into K classes; token ids in and
    [2, T, V] out predicts the next of V tokens."""
    what = f"{ref.function}()" if ref.function else f"hf:{ref.path.name}"
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == 2:
        return "classification", int(out.shape[-1])
    if ref.input == "text" and isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[:2] == (2, ref.shape[0]):
        return "language-modeling", int(out.shape[-1])
    expected = f"[batch, classes] or [batch, {ref.shape[0]}, vocabulary]" if ref.input == "text" else "[batch, classes]"
    raise UserError(f"{what} returns {shape} for a batch of 2: expected {expected}")


def _vocabulary(module: nn.Module) -> int:
    """The token vocabulary of a text model: its first embedding's size."""
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise UserError("a text model takes token ids into an nn.Embedding; this module has none")
    return embedding.num_embeddings


def user_model(name: str) -> ModelSpec:
    """The spec of a module in a file, built once per process and file content; a reference that pins a hash
    refuses a file (or folder) whose content differs (one line: what was registered is not what is here)."""
    ref = parse_reference(name)
    digest = file_hash(ref.path)
    if ref.digest and ref.digest != digest:
        raise UserError(
            f"model {ref.path} is not the one planned for: its SHA-256 is {digest[:12]}…, the job's {ref.digest[:12]}…"
            " (the file differs on this machine: copy the registered one here, or register it again)"
        )
    return _user_model(str(ref), digest)
