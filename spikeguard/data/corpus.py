"""Byte-level training data: the built-in corpus (the Python standard library) or a user path.

    .venv/bin/python -c "from spikeguard.data import load_corpus; print(load_corpus().source)"

B = sequences in a batch, T = sequence length, U8 = a flat uint8 byte stream.

Why the standard library: it is on every machine that runs spikeguard, needs no download,
and is real text with structure a small model learns within a few dozen steps. Bytes are
the tokens (vocabulary 256), so no tokenizer is needed and any file can be used.

Split rule (one rule for every input, so a single file works too): the files are read in
sorted order of their relative paths and concatenated; the first 90% of the bytes is the
training split and the last 10% the validation split. The built-in corpus is capped at
`DEFAULT_MAX_BYTES` (first bytes in sorted order) so that loading stays well under a second.
Its content depends on the Python version that runs it: `source` says which.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from spikeguard.errors import UsageError

DEFAULT_MAX_BYTES = 8 * 2**20
VAL_FRACTION = 0.1
# Third-party packages differ between machines and the test suites are mostly
# machine-generated data tables; both would make the corpus less reproducible.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})


@dataclass(kw_only=True)
class Corpus:
    """A byte stream split into training and validation parts."""

    train_U8: torch.Tensor
    val_U8: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        for name in ("train_U8", "val_U8"):
            t = getattr(self, name)
            assert t.dtype == torch.uint8 and t.dim() == 1, f"{name} must be a 1-D uint8 tensor"

    @property
    def num_bytes(self) -> int:
        return self.train_U8.numel() + self.val_U8.numel()

    def check_seq_len(self, seq_len: int) -> None:
        """Raise UsageError unless both splits hold one window of `seq_len` + 1 bytes.

        +1 because the targets are the inputs shifted by one byte.
        """
        need = seq_len + 1
        if self.train_U8.numel() < need or self.val_U8.numel() < need:
            raise UsageError(
                f"too little data for one sequence of {seq_len} tokens: {self.source} gives "
                f"{self.train_U8.numel()} training and {self.val_U8.numel()} validation bytes, "
                f"each split needs at least {need}")

    def get_batch(self, split: str, batch_size: int, seq_len: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows of `split`: (idx_BT, targets_BT), both int64.

        Window starts come only from `generator`, so a generator seeded from the training
        seed gives the same batches on every run.
        """
        data_U8 = self._split(split)
        max_start = data_U8.numel() - seq_len - 1
        if max_start < 0:
            self.check_seq_len(seq_len)
        start_B = torch.randint(0, max_start + 1, (batch_size,), generator=generator)
        offset_BT = start_B.unsqueeze(1) + torch.arange(seq_len + 1)
        window_BT = data_U8[offset_BT].long()
        return window_BT[:, :-1].contiguous(), window_BT[:, 1:].contiguous()

    def _split(self, split: str) -> torch.Tensor:
        if split == "train":
            return self.train_U8
        if split in ("val", "validation"):
            return self.val_U8
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its *.py files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath) / f for f in filenames
                     if f.endswith(".py") and not f.startswith("_sysconfigdata"))
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _tree_files(root: Path) -> list[Path]:
    files = [Path(d) / f for d, _, names in os.walk(root) for f in names]
    return sorted((p for p in files if p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())


def _read_capped(files: list[Path], max_bytes: Optional[int]) -> bytearray:
    buf = bytearray()
    for path in files:
        if max_bytes is not None and len(buf) >= max_bytes:
            break
        try:
            buf += path.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    if max_bytes is not None:
        del buf[max_bytes:]
    return buf


def _check_fits(files: list[Path], max_bytes: Optional[int], root: Path) -> None:
    """The bytes are read whole, then copied into a tensor: twice their size in memory."""
    from spikeguard.model.config import host_memory_bytes

    total = 0
    for path in files:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    if max_bytes is not None:
        total = min(total, max_bytes)
    have = host_memory_bytes()
    if have and 2 * total > have:
        raise UsageError(f"data path {root} holds {total / 2**30:.3g} GiB: reading it needs "
                         f"twice that, more than this machine's {have / 2**30:.3g} GiB of "
                         f"memory")


def split_bytes(buf: bytearray, source: str, val_fraction: float = VAL_FRACTION) -> Corpus:
    """The first (1 - val_fraction) of `buf` for training, the rest for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"val_fraction must be in (0, 1), got {val_fraction}")
    # frombuffer shares memory with `buf`; clone so the Corpus owns its bytes.
    all_U8 = torch.frombuffer(buf, dtype=torch.uint8).clone() if buf else \
        torch.empty(0, dtype=torch.uint8)
    num_train = len(buf) - int(len(buf) * val_fraction)
    return Corpus(train_U8=all_U8[:num_train], val_U8=all_U8[num_train:], source=source)


def load_corpus(path: Optional[str | os.PathLike] = None, *,
                max_bytes: Optional[int] = None) -> Corpus:
    """The built-in corpus (path None) or the bytes of a file or folder.

    A folder contributes all its files, recursively, sorted by relative path. `max_bytes`
    caps the bytes read; it defaults to DEFAULT_MAX_BYTES for the built-in corpus and to
    no cap for a user path (the user chose its size).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise UsageError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        root, files = stdlib_files()
        cap = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        buf = _read_capped(files, cap)
        source = (f"Python {sys.version_info.major}.{sys.version_info.minor} standard library "
                  f"({root}, {len(buf) / 2**20:.1f} MiB)")
        if not buf:
            raise UsageError(f"no Python source found under {root} for the built-in corpus; "
                             "pass --data PATH")
        return split_bytes(buf, source)

    p = Path(path)
    if not p.exists():
        raise UsageError(f"data path does not exist: {p}")
    if p.is_dir():
        files = _tree_files(p)
        if not files:
            raise UsageError(f"data folder has no files: {p}")
    elif not p.is_file():
        # /dev/zero or a pipe would be read until memory runs out, or forever.
        raise UsageError(f"data path {p} is not a regular file or a folder (a device, "
                         f"pipe or socket); give a file or a folder of files")
    else:
        files = [p]
    _check_fits([f for f in files], max_bytes, p)
    buf = _read_capped(files, max_bytes)
    source = f"{p} ({len(files)} files, {len(buf)} bytes)" if p.is_dir() else \
        f"{p} ({len(buf)} bytes)"
    if not buf:
        raise UsageError(f"data path is empty (no bytes): {p}")
    return split_bytes(buf, source)
