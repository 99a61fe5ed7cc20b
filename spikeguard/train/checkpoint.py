"""Checkpoints a restarted job resumes from, as a real training job's are, verified before use.

Every `every` steps (and after the last) each rank writes its own file `rank{r}.pt` (under
expert parallelism the ranks hold different experts): model, optimizer, the training data
generator and torch's global RNG, and the step. Each file is written atomically (a
temporary name, fsync, rename: spikeguard.files). Once every rank's file is in place (a
barrier under a process group), rank 0 writes `manifest.json`, last and atomically:

    {"format": "spikeguard-checkpoint", "version": 1, "step": 4,
     "layout": {"nproc": 2, "pp": 1, "dp": 1, "ep": 2, "schedule": "1f1b"},
     "model": {...the model's configuration...},
     "files": {"rank0.pt": {"bytes": 123, "sha256": "..."}, "rank1.pt": {...}}}

`--resume` reads the manifest on every rank before any collective (`verify`): the same
files, checksums, layout and model on every rank give every rank the same verdict, so a
bad checkpoint is one UsageError naming the file and what differs, never a collective
that some ranks enter and others do not. A resumed run continues bitwise where the
checkpointed one was (test).

A save is a two-phase commit, so that a job that dies in the middle of one (a pipeline
stage that finished its step and saved while a peer ran out of memory) still resumes
from a whole checkpoint: every rank writes `rank{r}.pt.next`; after a barrier rank 0
writes the manifest of those files under their final names (the commit point); after a
second barrier every rank renames its file into place. Dying before the manifest leaves
the previous checkpoint whole (the `.next` files match nothing and are ignored); dying
after it, `verify` finishes the renames the manifest vouches for.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from spikeguard.errors import OutputError, UsageError
from spikeguard.files import atomic_write

MANIFEST = "manifest.json"
FORMAT, VERSION = "spikeguard-checkpoint", 1


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def has_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` holds anything a resume could read (a manifest or a rank file)."""
    folder = Path(folder)
    return folder.is_dir() and ((folder / MANIFEST).exists() or any(folder.glob("rank*.pt")))


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise UsageError(f"cannot resume: {path} is missing, so {folder} holds no complete "
                         f"checkpoint")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as err:
        raise UsageError(f"cannot resume: {path} is not a checkpoint manifest "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"cannot resume: {path} is not a spikeguard checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise UsageError(f"cannot resume: {path} is version {manifest.get('version')!r}; "
                         f"this spikeguard reads version {VERSION}")
    for key, kind in (("step", int), ("layout", dict), ("model", dict), ("files", dict)):
        if not isinstance(manifest.get(key), kind):
            raise UsageError(f"cannot resume: {path} has no valid {key!r}")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and not isinstance(entry.get("bytes"), bool)
                and isinstance(entry.get("sha256"), str)):
            raise UsageError(f"cannot resume: {path} has no valid entry for {name!r} (an "
                             f"object with 'bytes' and 'sha256'), got {entry!r:.60}")
    return manifest


def _differences(what: str, saved: dict, here: dict) -> Optional[str]:
    diff = [f"{k} {saved.get(k)!r} (this run {here.get(k)!r})"
            for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k)]
    return f"it was saved by another {what}: {', '.join(diff)}" if diff else None


def verify(folder: str | Path, *, nproc: int, layout: Optional[dict] = None,
           model: Optional[dict] = None) -> dict:
    """The manifest of the checkpoint in `folder`, checked against this run and the files
    on disk; a UsageError naming what differs otherwise. Every rank reads the same bytes,
    so every rank decides alike."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    where = folder / MANIFEST
    for what, here in (("layout", layout), ("model", model)):
        if here is not None:
            differs = _differences(what, manifest[what], here)
            if differs:
                raise UsageError(f"cannot resume from {where}: {differs}")
    names = [f"rank{r}.pt" for r in range(nproc)]
    if sorted(manifest["files"]) != sorted(names):
        raise UsageError(f"cannot resume from {where}: it lists {', '.join(sorted(manifest['files']))}"
                         f" but this run has {nproc} rank(s)")
    for name in names:
        path, want = folder / name, manifest["files"][name]
        _roll_forward(path, want)
        if not path.is_file():
            raise UsageError(f"cannot resume: checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise UsageError(f"cannot resume: checkpoint file {path} is {size} bytes, the "
                             f"manifest says {want.get('bytes')} (truncated or replaced)")
        if sha256_of(path) != want.get("sha256"):
            raise UsageError(f"cannot resume: checkpoint file {path} does not match its "
                             f"checksum in {where} (corrupt or replaced)")
    return manifest


class Checkpointer:
    """Saves and restores one rank's training state in `folder`. `layout` and `model`
    (plain dicts) go into the manifest and are checked on resume; `group` is the process
    group whose ranks save together (None: one process)."""

    def __init__(self, folder: str | Path, every: int, rank: int = 0, resume: Any = False,
                 *, nproc: int = 1, layout: Optional[dict] = None,
                 model: Optional[dict] = None, group: Any = None):
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise UsageError(f"checkpoint interval must be a positive integer, got {every!r}")
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"checkpoint folder {folder} is a file")
        if resume is True and not folder.is_dir():
            raise UsageError(f"cannot resume: checkpoint folder {folder} does not exist")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create checkpoint folder {folder}: "
                             f"{exc.strerror or exc}") from None
        self.folder, self.rank, self.nproc = folder, rank, nproc
        self.path = folder / f"rank{rank}.pt"
        self.every = every
        self.resume = resume
        self.layout = layout or {"nproc": nproc}
        self.model = model or {}
        self.group = group

    def restore(self, model: nn.Module, optimizer,
                generator: torch.Generator) -> int:
        """Load the last checkpoint when resuming; returns its step (0: start afresh).
        `resume="auto"` starts afresh when the folder holds no checkpoint at all."""
        if not self.resume:
            return 0
        if self.resume == "auto" and not has_checkpoint(self.folder):
            return 0
        manifest = verify(self.folder, nproc=self.nproc, layout=self.layout, model=self.model)
        try:
            state = torch.load(self.path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizers = _as_list(optimizer)
            saved = _as_list(state["optimizer"])
            if len(saved) != len(optimizers):
                raise ValueError(f"it holds {len(saved)} optimizer states, this rank has "
                                 f"{len(optimizers)}")
            for opt, opt_state in zip(optimizers, saved):
                opt.load_state_dict(opt_state)
            generator.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            step = int(state["step"])
        except Exception as err:   # the bytes are the manifest's: a checkpoint of other code
            first = str(err).strip().splitlines()
            raise UsageError(f"checkpoint {self.path} does not fit this run: "
                             f"{' '.join(first[:2]) if first else type(err).__name__}") from None
        if step != manifest["step"]:
            raise UsageError(f"checkpoint {self.path} is at step {step} but {self.folder / MANIFEST}"
                             f" says {manifest['step']}")
        return step

    def after_step(self, step: int, model: nn.Module, optimizer,
                   generator: torch.Generator, last: bool) -> bool:
        """Save when `step` is on the interval or the last; returns whether it saved."""
        if step % self.every and not last:
            return False
        state = {"step": step, "model": model.state_dict(),
                 "optimizer": [o.state_dict() for o in optimizer]
                 if isinstance(optimizer, (list, tuple)) else optimizer.state_dict(),
                 "generator": generator.get_state(),
                 "torch_rng": torch.get_rng_state()}
        staged = _staged(self.path)
        atomic_write(staged, overwrite=True, what="checkpoint",
                     writer=lambda tmp: _save(state, tmp))
        self._barrier()              # every rank's new file is written
        if self.rank == 0:
            self._write_manifest(step)
        self._barrier()              # the manifest vouches for them: the commit point
        try:
            os.replace(staged, self.path)
        except OSError as exc:       # the manifest's roll-forward finishes it on resume
            raise OutputError(f"cannot write checkpoint {self.path}: "
                              f"{exc.strerror or exc}") from None
        return True

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist
            dist.barrier(group=self.group)

    def _write_manifest(self, step: int) -> None:
        files = {}
        for r in range(self.nproc):
            path = _staged(self.folder / f"rank{r}.pt")
            files[f"rank{r}.pt"] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        manifest = {"format": FORMAT, "version": VERSION, "step": step,
                    "layout": self.layout, "model": self.model, "files": files}
        atomic_write(self.folder / MANIFEST, json.dumps(manifest, indent=1) + "\n",
                     overwrite=True, what="checkpoint manifest")


def _save(state: dict, path: Path) -> None:
    """torch.save, whose failed writes are OSErrors: a full disk mid-file is torch's
    RuntimeError "[enforce fail at inline_container.cc:672] . unexpected pos N vs M", a
    folder it may not write "... open file failed with strerror: ..." (torch 2.13), which
    files.atomic_write would not see as a write that failed."""
    import errno
    import shutil

    try:
        torch.save(state, path)
    except RuntimeError as err:
        text = " ".join(str(err).split())
        if not any(mark in text for mark in ("inline_container", "PytorchStreamWriter",
                                               "file write failed")):
            raise   # not its file I/O layer: a bug, with its traceback
        try:
            full = shutil.disk_usage(path.parent).free == 0
        except OSError:
            full = False
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      "no space left on device" if full else
                      f"torch.save failed ({text[:120]})") from None


def _staged(path: Path) -> Path:
    return path.with_name(path.name + ".next")


def _roll_forward(path: Path, want: dict) -> None:
    """A save that died after its manifest: the staged file the manifest vouches for is
    renamed into place (idempotent; another rank may be doing the same)."""
    staged = _staged(path)
    if not staged.is_file() or (path.is_file() and sha256_of(path) == want.get("sha256")):
        return
    if staged.stat().st_size == want.get("bytes") and sha256_of(staged) == want.get("sha256"):
        try:
            os.replace(staged, path)
        except FileNotFoundError:
            pass   # renamed by another rank meanwhile


def _as_list(value) -> list:
    """One optimizer (or its state), or a pipeline rank's list of them (one per stage)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
