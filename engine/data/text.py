"""Next-token text for language models: the Python standard library's own source (pytext) or a file.

Tokens are bytes (0..255), or the token ids of a Hugging Face model folder's own tokenizer when it has one (the
text is then tokenized once per process). Both are cut the same way into non-overlapping windows of the model's
sequence length.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from engine.errors import UserError

STDLIB_BYTES = 4_000_000  # pytext: the sorted stdlib sources up to about this many bytes, so it is bounded
# Folders left out of pytext: third-party packages, and bulky tests and generated codec tables.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "encodings", "__pycache__"}
PYTEXT_TEST_EVERY = 10  # every 10th file of pytext is held out
TEXT_TEST_FRACTION = 10  # the last 1/10 of a text file is held out


def window_count(n_bytes: int, seq_len: int) -> int:
    """Windows of `seq_len` inputs (and one more byte for the last target) in `n_bytes`."""
    return max(0, (n_bytes - 1) // seq_len)


class ByteWindows(Dataset):
    """Window i: inputs data[i*L : i*L+L] and targets data[i*L+1 : i*L+L+1], both int64 of shape (L,)
    (SyntheticText's "language-modeling" form). `tokenizer`: a folder whose tokenizer turns the text into ids."""

    def __init__(self, data: bytes, seq_len: int, tokenizer: str = "") -> None:
        if tokenizer:
            self.data = torch.tensor(token_ids(tokenizer, data), dtype=torch.int64)
        else:
            self.data = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        self.seq_len = seq_len

    def __len__(self) -> int:
        return window_count(len(self.data), self.seq_len)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


@functools.lru_cache(maxsize=4)
def token_ids(tokenizer: str, data: bytes) -> list[int]:
    """The text's token ids by the tokenizer of the Hugging Face folder `tokenizer` (read from the folder only)."""
    return load_tokenizer(tokenizer)(data.decode("utf-8", errors="replace"))["input_ids"]


@functools.lru_cache(maxsize=4)
def load_tokenizer(folder: str):
    """The folder's tokenizer (a UserError when it cannot be read)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise UserError(f"cannot read the tokenizer in {folder}: {first[:160]}") from None
    tokenizer.model_max_length = 1 << 62  # a whole corpus at once; the windows cut it
    return tokenizer


def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted path order, up to STDLIB_BYTES in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    for folder, subfolders, filenames in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in STDLIB_SKIP]  # prune: site-packages alone can be huge
        names += [(Path(folder) / f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    files, total = [], 0
    for name in sorted(names):
        if total >= STDLIB_BYTES:
            break
        files.append(root / name)
        total += files[-1].stat().st_size
    if not files:
        raise UserError(f"dataset 'pytext' found no Python sources under {root}, this Python's standard library")
    return files


def pytext_files(train: bool = True) -> list[Path]:
    """pytext's split by file: every PYTEXT_TEST_EVERY-th file of stdlib_files() is held out."""
    return [f for k, f in enumerate(stdlib_files()) if (k % PYTEXT_TEST_EVERY == PYTEXT_TEST_EVERY - 1) != train]


def pytext(seq_len: int, train: bool = True, tokenizer: str = "") -> ByteWindows:
    return ByteWindows(b"".join(f.read_bytes() for f in pytext_files(train)), seq_len, tokenizer)


def pytext_train_size(seq_len: int, tokenizer: str = "") -> int:
    if tokenizer:  # (the tokens, counted)
        return len(pytext(seq_len, True, tokenizer))
    return window_count(sum(f.stat().st_size for f in pytext_files()), seq_len)


def text_file_size(path: str | Path | None, seq_len: int) -> int:
    """The size of the text file at `path`; UserError if it is missing, empty or too short to split."""
    if path is None:
        raise UserError("dataset 'text' needs a text file: give --data-dir FILE")
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"text file {path} not found" + (" (it is a folder)" if path.is_dir() else ""))
    size = path.stat().st_size
    need = TEXT_TEST_FRACTION * (seq_len + 1)
    if size == 0:
        raise UserError(f"text file {path} is empty")
    if size < need:
        raise UserError(
            f"text file {path} has {size} bytes; windows of {seq_len} need at least {need}, so that its held-out "
            f"last 1/{TEXT_TEST_FRACTION} holds one window of {seq_len + 1} bytes"
        )
    return size


def text_file(path: str | Path | None, seq_len: int, train: bool = True, tokenizer: str = "") -> ByteWindows:
    """The file's bytes before (train) or in (test) its last 1/TEXT_TEST_FRACTION."""
    text_file_size(path, seq_len)
    data = Path(path).expanduser().read_bytes()
    cut = len(data) - len(data) // TEXT_TEST_FRACTION
    return ByteWindows(data[:cut] if train else data[cut:], seq_len, tokenizer)


def text_file_train_size(path: str | Path | None, seq_len: int, tokenizer: str = "") -> int:
    size = text_file_size(path, seq_len)
    if tokenizer:
        return len(text_file(path, seq_len, True, tokenizer))
    return window_count(size - size // TEXT_TEST_FRACTION, seq_len)
