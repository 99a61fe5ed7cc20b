"""Checkpoints a restarted job resumes from, written with torch.distributed.checkpoint (DCP),
verified before use, and resharded into another expert x data-parallel layout on resume.

Every `every` steps (and after the last) the ranks save together, with `dcp.save`, into a
fresh folder `step-<N>/`: DCP's own format (one `__<rank>_0.distcp` file per rank that
writes, and `.metadata`), which torchtitan and DCP's own tools read. What is in it, and
under which keys, is spikeguard.train.checkpoint_state: model, optimizer, each data
shard's position, each rank's RNG and its guards' learned state (spikeguard.runtime.
learned), experts keyed by global index. Once DCP has written everything (its `.metadata`
last), rank 0 writes `manifest.json` beside the folder, atomically (spikeguard.files):

    {"format": "spikeguard-checkpoint", "version": 2, "step": 4, "folder": "step-4",
     "layout": {"nproc": 2, "pp": 1, "dp": 1, "ep": 2, "schedule": "1f1b"},
     "model": {...the model's configuration...},
     "files": {"step-4/.metadata": {"bytes": 123, "sha256": "..."}, "step-4/__0_0.distcp": ...}}

The manifest is the commit point: a job that dies during a save (DCP writing, or between
DCP and the manifest) leaves the manifest naming the previous folder, whole; the next save
removes what the dead one left. After the manifest, rank 0 removes the folders it no longer
names.

`--resume` reads the manifest on every rank before any collective (`verify`): the same
files, sizes, checksums, model, and a layout this run can take, give every rank the same
verdict, so a bad checkpoint is one UsageError naming the file and what differs, never a
collective that some ranks enter and others do not. A resume in the same layout continues
bitwise (test). A checkpoint of a run without a pipeline resumes into another EP / DP
layout of the same model (the user's choice, said on the command line): each rank loads
its own experts whoever saved them, the data shards replay their draws up to the step
(spikeguard.train.loop), and the guards start cold (their figures are per rank and layout).
A pipeline's checkpoint (each rank's stages saved apart) resumes only in its own layout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from spikeguard.errors import OutputError, UsageError
from spikeguard.files import atomic_write

MANIFEST = "manifest.json"
FORMAT, VERSION = "spikeguard-checkpoint", 2
_STEP_FOLDER = "step-"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def has_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` holds anything a resume could read (a manifest or a saved folder)."""
    folder = Path(folder)
    return folder.is_dir() and ((folder / MANIFEST).exists()
                                or any(folder.glob(f"{_STEP_FOLDER}*"))
                                or any(folder.glob("rank*.pt")))


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
                         f"this spikeguard reads version {VERSION} (DCP)")
    for key, kind in (("step", int), ("layout", dict), ("model", dict), ("files", dict),
                      ("folder", str)):
        if not isinstance(manifest.get(key), kind):
            raise UsageError(f"cannot resume: {path} has no valid {key!r}")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and not isinstance(entry.get("bytes"), bool)
                and isinstance(entry.get("sha256"), str)):
            raise UsageError(f"cannot resume: {path} has no valid entry for {name!r} (an "
                             f"object with 'bytes' and 'sha256'), got {entry!r:.60}")
        if Path(name).parent != Path(manifest["folder"]) or name.startswith("/"):
            raise UsageError(f"cannot resume: {path} lists {name!r}, outside its folder "
                             f"{manifest['folder']!r}")
    return manifest


def _differences(what: str, saved: dict, here: dict) -> Optional[str]:
    diff = [f"{k} {saved.get(k)!r} (this run {here.get(k)!r})"
            for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k)]
    return f"it was saved by another {what}: {', '.join(diff)}" if diff else None


def same_layout(saved: dict, here: dict) -> bool:
    """The same layout; without a pipeline the schedule means nothing."""
    if saved.get("pp") == here.get("pp") == 1:
        saved, here = ({k: v for k, v in d.items() if k != "schedule"} for d in (saved, here))
    return saved == here


def reshards(saved: dict, here: dict) -> bool:
    """Whether a checkpoint of another layout `saved` loads into layout `here` (module
    doc): only between layouts without a pipeline."""
    return saved.get("pp", 1) == here.get("pp", 1) == 1


def verify(folder: str | Path, *, nproc: int, layout: Optional[dict] = None,
           model: Optional[dict] = None) -> dict:
    """The manifest of the checkpoint in `folder`, checked against this run and the files
    on disk; a UsageError naming what differs otherwise. Every rank reads the same bytes,
    so every rank decides alike. `nproc` is this run's (the layout says it too)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    where = folder / MANIFEST
    differs = _differences("model", manifest["model"], model) if model is not None else None
    if differs:
        raise UsageError(f"cannot resume from {where}: {differs}")
    here = layout if layout is not None else {"nproc": nproc}
    if not same_layout(manifest["layout"], here) and not reshards(manifest["layout"], here):
        raise UsageError(f"cannot resume from {where}: "
                         f"{_differences('layout', manifest['layout'], here)} (only a run "
                         f"without a pipeline resumes into another layout, from one without)")
    for name, want in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise UsageError(f"cannot resume: checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise UsageError(f"cannot resume: checkpoint file {path} is {size} bytes, the "
                             f"manifest says {want['bytes']} (truncated or replaced)")
        if sha256_of(path) != want["sha256"]:
            raise UsageError(f"cannot resume: checkpoint file {path} does not match its "
                             f"checksum in {where} (corrupt or replaced)")
    return manifest


class Checkpointer:
    """Saves and restores one rank's training state in `folder`. `layout` and `model`
    (plain dicts) go into the manifest and are checked on resume; `group` is the process
    group whose ranks save together (None: one process); `shard`: this rank's data shard."""

    def __init__(self, folder: str | Path, every: int, rank: int = 0, resume: Any = False,
                 *, nproc: int = 1, layout: Optional[dict] = None,
                 model: Optional[dict] = None, group: Any = None, shard: int = 0):
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
        self.folder, self.rank, self.nproc, self.shard = folder, rank, nproc, shard
        self.every = every
        self.resume = resume
        self.layout = layout or {"nproc": nproc}
        self.model = model or {}
        self.group = group
        self.resharded = False      # the last restore came from another layout
        self.data_restored = False  # ... and set the data generator (else: replay it)
        self.guard_states: Optional[list] = None
        self.note = ""              # what the last restore did, one line for the console

    def restore(self, parts, generator: torch.Generator, *, reshardable: bool = True) -> int:
        """Load the last checkpoint into `parts` ((module, optimizer) pairs) and the data
        `generator` when resuming; returns its step (0: start afresh). `resume="auto"`
        starts afresh when the folder holds no checkpoint at all."""
        from spikeguard.train.checkpoint_state import TrainingState

        if not self.resume or (self.resume == "auto" and not has_checkpoint(self.folder)):
            return 0
        manifest = verify(self.folder, nproc=self.nproc, layout=self.layout, model=self.model)
        self.resharded = not same_layout(manifest["layout"], self.layout)
        if self.resharded and not reshardable:
            raise UsageError(f"cannot resume from {self.folder / MANIFEST}: this run's model "
                             f"is cut into pipeline stages, saved per rank")
        saved = self.folder / manifest["folder"]
        keys = TrainingState(parts, rank=self.rank, shard=self.shard, reshardable=reshardable)
        import torch.distributed.checkpoint as dcp

        try:
            reader = dcp.FileSystemReader(saved)
            metadata = reader.read_metadata().state_dict_metadata
            step, self.guard_states = keys.load(
                lambda dest: _quiet(dcp.load, dest, storage_reader=reader,
                                    process_group=self.group, no_dist=self.group is None),
                metadata, same_layout=not self.resharded)
        except (Exception, dcp.CheckpointException) as err:   # vouched bytes, other code
            raise UsageError(f"checkpoint {saved} does not fit this run: "
                             f"{_first_line(err)}") from None
        if step != manifest["step"]:
            raise UsageError(f"checkpoint {saved} is at step {step} but {self.folder / MANIFEST}"
                             f" says {manifest['step']}")
        self.data_restored = keys.data_state is not None
        self.note = f"checkpoint: resumed at step {step} from {saved}" + (
            f", saved as {_layout_text(manifest['layout'])} and resharded into "
            f"{_layout_text(self.layout)} (experts by global index; each data shard replays "
            f"its draws to step {step}; the guards start cold)" if self.resharded else
            ", the guards warm" if self.guard_states else "")
        if keys.data_state is not None:
            generator.set_state(keys.data_state)
        if keys.rng_state is not None:
            torch.set_rng_state(keys.rng_state)
        return step

    def restore_guards(self, guards) -> bool:
        """Give the guards attached after `restore` what the saved ones had learned (same
        layout only, and one saved state per guard); returns whether it did."""
        states = self.guard_states
        if self.resharded or not states or len(states) != len(guards):
            return False
        for guard, state in zip(guards, states):
            guard.load_state_dict(state)
        return True

    def after_step(self, step: int, parts, generator: torch.Generator, last: bool, *,
                   guards=(), reshardable: bool = True) -> bool:
        """Save when `step` is on the interval or the last; returns whether it saved."""
        from spikeguard.train.checkpoint_state import TrainingState

        if step % self.every and not last:
            return False
        keys = TrainingState(parts, rank=self.rank, shard=self.shard, reshardable=reshardable)
        state = keys.to_save(step, generator, guards)
        name = self._fresh_folder(step)
        self._write(state, self.folder / name)
        self._barrier()              # every rank's part is written, and DCP's .metadata
        if self.rank == 0:
            self._write_manifest(step, name)
        self._barrier()              # the manifest names the new folder: the commit point
        if self.rank == 0:
            self._remove_stale(keep=name)
        return True

    def _fresh_folder(self, step: int) -> str:
        """The new folder's name, never the one the manifest names now (a second save of
        a step: --overwrite, --resume auto), emptied of what a dead save left there."""
        name = f"{_STEP_FOLDER}{step}"
        current = _committed_folder(self.folder)
        if current == name:
            name += "-b"
        if self.rank == 0 and (self.folder / name).exists():
            shutil.rmtree(self.folder / name, ignore_errors=True)
        self._barrier()
        return name

    def _write(self, state: dict, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            _quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(path),
                   process_group=self.group, no_dist=self.group is None)
        except (OSError, RuntimeError, dcp.CheckpointException) as err:
            if self.rank == 0:   # the manifest still names the last whole checkpoint
                shutil.rmtree(path, ignore_errors=True)
            raise OutputError(f"cannot write checkpoint {path}: {_first_line(err)}") from None

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist
            dist.barrier(group=self.group)

    def _write_manifest(self, step: int, name: str) -> None:
        files = {}
        for path in sorted((self.folder / name).iterdir()):
            files[f"{name}/{path.name}"] = {"bytes": path.stat().st_size,
                                            "sha256": sha256_of(path)}
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "folder": name,
                    "layout": self.layout, "model": self.model, "files": files}
        atomic_write(self.folder / MANIFEST, json.dumps(manifest, indent=1) + "\n",
                     overwrite=True, what="checkpoint manifest")

    def _remove_stale(self, keep: str) -> None:
        """The folders of earlier saves (and of a save that died), no longer named, and
        the per-rank files of the format before DCP (version 1) that --overwrite replaced."""
        for path in self.folder.glob(f"{_STEP_FOLDER}*"):
            if path.name != keep and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        for path in [*self.folder.glob("rank*.pt"), *self.folder.glob("rank*.pt.next")]:
            path.unlink(missing_ok=True)


def _quiet(fn, *args, **kwargs):
    """DCP's call without its warning that one process saves alone (torch 2.13 warns even
    when told so with no_dist=True): one process is a layout of its own here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def _layout_text(layout: dict) -> str:
    return " x ".join(f"{k} {layout[k]}" for k in ("pp", "dp", "ep") if k in layout) or \
        f"nproc {layout.get('nproc')}"


def _committed_folder(folder: Path) -> Optional[str]:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("folder")
    except (OSError, ValueError, AttributeError):
        return None


def _first_line(err: BaseException) -> str:
    """One line of an error; of DCP's CheckpointException, the first rank's cause."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    first = [line for line in str(err).strip().splitlines() if line.strip()]
    text = " ".join(first[:2]) if first else type(err).__name__
    return text if len(text) < 300 else text[:297] + "..."
