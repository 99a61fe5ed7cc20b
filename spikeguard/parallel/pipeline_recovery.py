"""A pipeline rank that runs out of memory plays the rest of the schedule as a ghost.

Under a pipeline the peers of a rank are of two kinds: its expert-parallel peers (the same
stage), which meet it in all-to-alls, and the other stages, which meet it in the
schedule's sends and receives. A GPU refuses an allocation at once, on that rank alone,
and all of them go on. So a rank whose stage fails anywhere in a step (an own forward
that even the micro-batch net could not save, a backward, the loss) does not leave the
schedule: from there on each of its stage actions is a *ghost*:

- a forward returns random rows of the stage output's shape (a private generator: the
  job's random state is untouched; random rather than zeros, which would route every
  token of the next stage to the same experts) and the first one delivers this rank's
  note at the stage's first flag point, where its EP peers learn it (they become ghosts);
- a backward makes the reverse exchanges its EP peers wait in for that micro-batch (the
  journal's sizes: spikeguard.parallel.exchange_journal) and gives zero input gradients
  (no replica reduces during the schedule: PipelineRank reduces after the step);
- the schedule's own sends and receives run unchanged (they are outside the stage's
  forward and backward), with the ghost's tensors.

At the step's end every rank makes one all-gather of notes over the whole job
(`step_end`; a note not yet told to the EP peers goes there): every rank then holds the
same notes, and every rank re-runs the step with full recompute, or every rank ends the
job with the same line (spikeguard.runtime.step). Nothing can hang by construction:
every rank runs every action of the schedule.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from spikeguard.errors import DeviceOutOfMemory
from spikeguard.parallel.agreement import gathered
from spikeguard.runtime.agreement import (ABORT, NONE, NOTE_FIELDS, STEP, GroupFailure, Note,
                                          worst)
from spikeguard.runtime.net import failure_note


class PipelineRecovery:
    """The ghost state of one pipeline rank for the step in progress."""

    def __init__(self, guards: list, stages: list, agreement):
        self.guards = guards
        self.stages = stages
        self.agreement = agreement            # the stage's EP group (None without EP)
        self.rerun = False
        self.notes: list[Note] = []           # what this rank knows failed in this step
        self.owed: Optional[Note] = None      # its own note, not yet told to its EP peers
        self.generator = torch.Generator(device=stages[0].device).manual_seed(0)
        for stage in stages:
            stage.forward_one_chunk = functools.partial(self.forward, stage,
                                                        stage.forward_one_chunk)
            stage.backward_one_chunk = functools.partial(self.backward, stage,
                                                         stage.backward_one_chunk)

    @property
    def ghost(self) -> bool:
        return bool(self.notes)

    def begin_step(self, rerun: bool) -> None:
        self.notes, self.owed, self.rerun = [], None, rerun

    # ---- the stage's actions ------------------------------------------------------------
    def forward(self, stage, orig, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        if not self.ghost:
            try:
                return orig(fwd_chunk_id, args, kwargs, save_forward_output)
            except RuntimeError as err:   # PipelineStage wraps the stage's own errors
                failure = device_failure(err)
                if failure is None:
                    raise
                self._note(failure)
                del failure   # its traceback holds the failed attempt's frames
            self._fail()
        return self._ghost_forward(stage, fwd_chunk_id, args, kwargs, save_forward_output)

    def backward(self, stage, orig, bwd_chunk_id, loss=None, full_backward=True,
                 last_backward=False):
        if not self.ghost:
            try:
                return orig(bwd_chunk_id, loss, full_backward, last_backward)
            except RuntimeError as err:   # stage_backward wraps them too
                failure = device_failure(err)
                if failure is None:
                    raise
                self._note(failure)
                del failure
            self._fail(in_backward=bwd_chunk_id, stage=stage)
            return self._ghost_backward(stage, bwd_chunk_id, last_backward, settled=True)
        return self._ghost_backward(stage, bwd_chunk_id, last_backward)

    def loss(self, loss_fn, output, target):
        """The schedule's loss on the last stage: a ghost's is a zero."""
        if not self.ghost:
            try:
                return loss_fn(output, target)
            except RuntimeError as err:
                failure = device_failure(err)
                if failure is None:
                    raise
                self._note(failure)
                del failure
            self._fail()
        return torch.zeros((), device=output.device)

    # ---- becoming a ghost ---------------------------------------------------------------
    def _note(self, err) -> None:
        """What failed: the group's notes if it was learned at a flag point (or agreed
        there), else this rank's own note, to tell its peers."""
        if isinstance(err, GroupFailure):
            self.notes = list(err.notes)
            return
        guard = self.guards[0]
        err = guard.device_oom(err)
        kind = ABORT if self.rerun or guard.policy != "adaptive" else STEP
        self.owed = failure_note(guard, kind, err, dist.get_rank())
        self.notes = [self.owed]

    def _fail(self, in_backward: Optional[int] = None, stage=None) -> None:
        """This rank's step failed (noted): free what it holds, then make the exchanges
        of the micro-batch in backward that its EP peers wait in."""
        for s in self.stages:
            s.fwd_cache.clear()        # every resident micro-batch's graph goes
        for guard in self.guards:
            guard.free_attempt()
        if in_backward is not None and self.agreement is not None:
            self._settle(stage, in_backward)

    def _settle(self, stage, micro_batch: int) -> None:
        journal = self._journal(stage)
        if journal is not None:
            journal.settle_reverse(micro_batch)

    def _journal(self, stage):
        guard = self.guards[self.stages.index(stage)]
        agreement = guard.net.agreement
        return getattr(agreement, "journal", None)

    # ---- the ghost's actions -----------------------------------------------------------
    def _ghost_forward(self, stage, fwd_chunk_id, args, kwargs, save_forward_output):
        inputs = args if stage.is_first else stage._retrieve_recv_activations(fwd_chunk_id)
        if self.owed is not None and self.agreement is not None:
            journal = self._journal(stage)
            if journal is not None:   # the stage's first flag point: the peers learn here
                self.notes += journal.flag_point(None, self.owed, stage.device)[1]
                self.owed = None
        meta = stage._stage_meta.outputs[0]
        out = torch.randn(meta.shape, dtype=meta.dtype, device=stage.device,
                          generator=self.generator)
        if stage.is_last and save_forward_output:
            stage.output_chunks.append(out)
        stage.fwd_cache[fwd_chunk_id] = ((out,), [t for t in inputs if torch.is_tensor(t)])
        return out

    def _ghost_backward(self, stage, bwd_chunk_id, last_backward, settled=False):
        if not stage.has_backward:
            return
        stage.fwd_cache.pop(bwd_chunk_id, None)
        if not stage.is_last:
            stage._retrieve_recv_grads(bwd_chunk_id)
        if not settled and self.agreement is not None:
            self._settle(stage, bwd_chunk_id)
        if stage.is_first:
            grads = (None,) * len(stage._stage_meta.inputs)
        else:
            grads = tuple(torch.zeros(m.shape, dtype=m.dtype, device=stage.device)
                          for m in stage._stage_meta.inputs)
        stage.bwd_cache[bwd_chunk_id] = grads

    # ---- the step's end -----------------------------------------------------------------
    def step_end(self) -> list[Note]:
        """One all-gather of each rank's worst note over the whole job: every rank returns
        the same notes (empty: the step stands). A note still owed to the EP peers goes
        in it too: every rank of the stage played the whole schedule (a ghost makes every
        exchange its peers wait in), so none of them waits in an exchange here, and the
        all-gather tells them as a stage's flag point would (one collective fewer a step)."""
        notes = list(self.notes)   # the owed note is among them (`_note`)
        self.owed = None
        mine = torch.tensor(worst(notes).as_list() if notes else Note().as_list(),
                            dtype=torch.int64, device=self.stages[0].device)
        out = torch.empty(dist.get_world_size() * NOTE_FIELDS, dtype=torch.int64,
                          device=mine.device)
        gathered(out, mine, None)   # freed here, not on gloo's thread
        return [n for n in (Note(*row) for row in out.view(-1, NOTE_FIELDS).tolist())
                if n.kind != NONE]


def device_failure(err: BaseException) -> Optional[BaseException]:
    """The device's refusal (or the guard's error for it) that `err` is or wraps, if any:
    PipelineStage re-raises a stage's errors as a RuntimeError "from" them."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, (DeviceOutOfMemory, torch.OutOfMemoryError)):
            return err
        err, seen = err.__cause__, seen + 1
    return None
