"""What a training run reads and writes, checked before any process starts (and again in
every rank where a rank must see it itself): the log, traces, checkpoints and their
manifest, outputs that would replace inputs or existing files (spikeguard.files).
spikeguard.train.run calls `check_files` first; every mistake is one UsageError."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.train.config import RunConfig


def rank_log(path: Optional[str], rank: int) -> Optional[str]:
    """Rank 0 writes `path`; rank r, `stem.rank{r}.ext`."""
    if path is None or not rank:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.rank{rank}.{ext}" if dot else f"{path}.rank{rank}"


def check_files(cfg: RunConfig) -> None:
    """What the run reads and writes: every mistake before any process starts. Under
    torchrun the launcher checked whether outputs exist (a rank would see its peers'
    new files); each rank still opens its own exclusively."""
    from spikeguard.parallel.launch import under_torchrun

    files = cfg.files
    if files.checkpoint_dir is not None:
        check_checkpoint_dir(files.checkpoint_dir)
    if files.tensorboard is not None:
        check_tensorboard(cfg)
    if files.wandb is not None:
        check_wandb(cfg)
    if files.memory_snapshot is not None:
        check_checkpoint_dir(files.memory_snapshot, "--memory-snapshot")
        check_not_in_data(cfg, files.memory_snapshot, "--memory-snapshot", "snapshot files")
    if files.resume is True and not Path(files.checkpoint_dir).is_dir():
        raise UsageError(f"cannot resume: --checkpoint-dir {files.checkpoint_dir} does not exist")
    if files.record_trace is not None:
        folder = Path(files.record_trace).parent
        if Path(files.record_trace).is_dir() or not folder.is_dir():
            raise UsageError(f"--record-trace needs a file in an existing folder, "
                             f"got {files.record_trace}")
    launcher = not under_torchrun()
    check_outputs_of(cfg, exist=launcher)
    if files.trace is not None:
        load_trace(cfg)
    check_resume(cfg)


def check_checkpoint_dir(path: str, what: str = "--checkpoint-dir") -> None:
    """The folder exists and can be written, or can be created (its nearest existing
    ancestor is a writable folder): a save that fails after the first step is found now."""
    folder = Path(path)
    if not path:
        raise UsageError(f"{what} needs a folder, got an empty path")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} {path} is a file")
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{what} {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is not writable" if existing == folder.absolute() else \
            f"cannot be created: {existing} is not writable"
        raise UsageError(f"{what} {path} {why}")


def check_tensorboard(cfg: RunConfig) -> None:
    """--tensorboard: the package is there, and the folder can be written and is not
    inside --data (the next run would read the event files as training data)."""
    from spikeguard.extras import require

    files = cfg.files
    check_checkpoint_dir(files.tensorboard, "--tensorboard")
    require("tensorboard", "tensorboard", "--tensorboard")
    check_not_in_data(cfg, files.tensorboard, "--tensorboard", "event files")


def check_wandb(cfg: RunConfig) -> None:
    """--wandb: a project name W&B takes, the package, a WANDB_MODE it knows, and the
    folder its run files go to (WANDB_DIR, else the current one) writable and not inside
    --data. W&B's own Settings judge the name and the mode: its rules, not a copy."""
    from spikeguard.extras import require
    from spikeguard.train.metrics import wandb_mode

    project = cfg.files.wandb
    if not project.strip():
        raise UsageError("--wandb needs a project name, got an empty one")
    wandb = require("wandb", "wandb", "--wandb")
    mode = wandb_mode()
    try:
        wandb.Settings(project=project, mode=mode)
    except wandb.errors.UsageError as err:   # the name: one line, naming the rule broken
        raise UsageError(f"--wandb: {err}") from None
    except ValueError:   # pydantic's, for the mode: several lines
        raise UsageError(f"WANDB_MODE={mode} is not a W&B mode: use online, offline or "
                         f"disabled") from None
    folder = os.environ.get("WANDB_DIR")
    if folder is not None:
        check_checkpoint_dir(folder, "WANDB_DIR")
    elif not os.access(".", os.W_OK | os.X_OK):
        raise UsageError(f"--wandb writes its run under the current folder {os.getcwd()}, "
                         f"which is not writable; set WANDB_DIR to a folder that is")
    check_not_in_data(cfg, folder or ".", "--wandb's folder" if folder is None else
                      "WANDB_DIR", "W&B run files")


def check_not_in_data(cfg: RunConfig, folder: str, flag: str, what: str) -> None:
    """An output folder inside the --data folder: the next run would train on it."""
    data = cfg.files.data
    if data is not None and Path(data).is_dir() and Path(os.path.realpath(
            folder)).is_relative_to(os.path.realpath(data)):
        raise UsageError(f"{flag} {folder} is inside the --data folder {data} (the next run "
                         f"would read the {what} as training data); write it elsewhere")


def check_outputs_of(cfg: RunConfig, exist: bool = True) -> None:
    """No output is an input or another output; with `exist`, an existing output needs
    --overwrite (the log: or --resume, which appends to it). spikeguard.files' rules."""
    from spikeguard.files import check_outputs, same_file
    from spikeguard.train.checkpoint import MANIFEST, has_checkpoint

    files = cfg.files
    nproc = cfg.parallel.nproc
    logs = [rank_log(files.log, r) for r in range(nproc)] if files.log is not None else None
    ck = Path(files.checkpoint_dir) if files.checkpoint_dir is not None else None
    # The manifest and what the saves wrote beside it (DCP's folders: train/checkpoint.py).
    ck_files = [ck / MANIFEST] + sorted(ck.glob("step-*/*")) if ck else None
    inputs = {"--trace": files.trace, "--data": files.data,
              "--config": _config_path(cfg.argv)}
    if ck is not None and files.data is not None and Path(files.data).is_dir() and \
            Path(os.path.realpath(ck)).is_relative_to(os.path.realpath(files.data)):
        # The corpus is every file under --data: the next run would train on checkpoints.
        raise UsageError(f"--checkpoint-dir {ck} is inside the --data folder {files.data} "
                         f"(the next run would read the checkpoints as training data); "
                         f"save it elsewhere")
    if ck is not None and files.overwrite and not files.resume:
        from spikeguard.files import check_replaceable
        for path in ck_files:
            if path.exists():
                check_replaceable("--checkpoint-dir file", path)
    outputs = {"--log": logs, "--record-trace": files.record_trace}
    if exist:
        check_outputs(outputs, inputs=inputs, overwrite=files.overwrite,
                      append=("--log",) if files.resume else ())
        if ck is not None and not files.resume and not files.overwrite and has_checkpoint(ck):
            raise UsageError(f"--checkpoint-dir {ck} holds a checkpoint; pass --resume to "
                             f"continue it or --overwrite to replace it")
    else:
        check_outputs(outputs, inputs=inputs, overwrite=True)
    for name, paths in (("--log", logs), ("--record-trace", [files.record_trace])):
        for path in paths or ():
            for other in (ck_files or []) + [p for p in (files.trace, files.data) if p]:
                if path is not None and same_file(path, other):
                    raise UsageError(f"{name} {path} would overwrite {other}; write it elsewhere")


def _config_path(argv) -> str | None:
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def checkpoint_identity(cfg: RunConfig) -> tuple[dict, dict]:
    """(layout, model) as a checkpoint's manifest records them (plain JSON values)."""
    import json

    L = cfg.layout
    layout = {"nproc": L.nproc, "pp": L.pp, "dp": L.dp, "ep": L.ep,
              "schedule": cfg.parallel.schedule}
    family = cfg.model.family
    if family == "builtin":
        model = {"family": family, **cfg.model.builtin.to_dict()}
    else:   # hf, titan: the name and the sizes given (a new family is never "builtin")
        model = {"family": family, family: cfg.model.name, **cfg.model.overrides}
    return layout, json.loads(json.dumps(model))


def check_resume(cfg: RunConfig) -> None:
    """--resume: the checkpoint's manifest and files, checked on every rank before any
    collective (every rank reads the same bytes, so all refuse alike); an empty folder is
    refused unless --resume auto; a checkpoint at or past --steps leaves nothing to do."""
    from spikeguard.train.checkpoint import has_checkpoint, verify

    files = cfg.files
    if not files.resume:
        return
    folder = Path(files.checkpoint_dir)
    if not has_checkpoint(folder):
        if files.resume == "auto":
            return
        raise UsageError(f"cannot resume: --checkpoint-dir {folder} holds no checkpoint "
                         f"(--resume auto starts afresh when there is none)")
    layout, model = checkpoint_identity(cfg)
    manifest = verify(folder, nproc=cfg.parallel.nproc, layout=layout, model=model)
    if manifest["step"] >= cfg.train.steps:
        raise UsageError(f"cannot resume: the checkpoint in {folder} is at step "
                         f"{manifest['step']}, and --steps is {cfg.train.steps}: nothing left "
                         f"to train (raise --steps)")


def load_trace(cfg: RunConfig):
    from spikeguard.routing.trace import load_trace

    model = cfg.model.builtin
    trace = load_trace(cfg.files.trace)
    trace.check_matches(steps=cfg.train.steps, num_layers=model.num_layers,
                        num_experts=model.num_experts, top_k=model.top_k, ep=cfg.layout.ep,
                        micro_batches=cfg.train.micro_batches,
                        tokens_per_micro_batch=cfg.tokens_per_micro_batch)
    return trace
