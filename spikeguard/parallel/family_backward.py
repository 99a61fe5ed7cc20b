"""A backward refused under transformers' EP with FSDP2: the rest of its collectives
replayed with zeros (for spikeguard.parallel.family_journal's `settle_backward`).

R = ranks of the EP group. The collectives a micro-batch's backward makes, from the flag
point that ends its forward to the next flag point (the next micro-batch's, or the
step's end), are deterministic given that forward: per FSDP unit in reverse, FSDP2's
all-gather (with its prefetch), the layer's two backward all-to-alls (the combine's
reverse, then the dispatch's, sized by the forward's exchange), the unit's
reduce-scatter; then the next forward's collectives before its first flag point (the
root's all-gather). A `Span` records them as issued (a TorchDispatchMode sees the c10d
and functional-collective ops that FSDP2 and autograd issue: observed, never
re-implemented). The span of the same micro-batch, under the same whole-layer decisions,
in an earlier step is the *template*: its row all-to-alls are named by the forward
exchange they reverse, so this step's sizes replace the template's. Once a key's span
has been seen twice alike (`alike`: the same ops, groups and order, the rows sized by
each step's exchanges), the mode is no longer pushed for it (the mode sees every
backward op: its cost is per op): the span only reads each group's sequence number at
its start and end, and a refusal is placed in the template by those counts alone (the
template's first n collectives, per group, are those issued). An unwatched span whose
counts differ from its template's drops the template: that key is watched again.

A rank refused in backward replays, with zero buffers, the template's collectives after
those its own span issued, in the same order, with the same ops, groups and reduce ops,
then makes its flag point. Only where it is known: the span's count equals the groups'
sequence numbers (a collective issued outside the recorder's sight fails it), the
template's first collectives equal those issued (kinds, shapes, sizes; unwatched: their
count on each group, no more than the template's), and each row
all-to-all matched, in order, the reverse of one forward exchange, and no layer is
recomputed whole in what is owed (its recompute re-runs the peers' routing and counts
exchange on what they receive: zeros would change their sizes). Anything else (no
template: the first step's backward; another order) is no replay: the job ends on every
rank in one agreed line (GroupAgreement.end_job). The data replayed is zeros: the peers'
gradients of the step are wrong, and thrown away when every rank re-runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_map_only

from spikeguard.parallel.release import handed, let_go

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# No exchange: the waits of issued collectives, and the functional autograd all-to-all's
# wrapping of a cached output (a recomputed layer's, in backward). The groups' sequence
# numbers check the count (Span.end).
LOCAL_OPS = ("wait_tensor", "_wrap_tensor_autograd")
ROWS = "all_to_all_single"     # the functional all-to-all transformers' rows take


@dataclass(frozen=True)
class Spec:
    """A tensor argument of a collective: what a zero buffer needs."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class Collective:
    """One collective as issued: its op, its arguments with tensors as `Spec`s, and for a
    row all-to-all the forward exchange it reverses (index, "combine" or "dispatch")."""

    func: object
    args: tuple
    kwargs: dict
    reverses: Optional[tuple] = None

    def key(self) -> tuple:
        return (str(self.func), _key(self.args), _key(tuple(sorted(self.kwargs.items()))))

    def sized(self, exchanges: list) -> "Collective":
        """This collective with the sizes of `exchanges[i]` (send, recv) where it reverses
        one: a combine's reverse sends the dispatch's send sizes and receives its
        receive sizes; a dispatch's reverse the other way."""
        if self.reverses is None:
            return self
        index, phase = self.reverses
        send, recv = exchanges[index]
        out_of, in_of = (recv, send) if phase == "combine" else (send, recv)
        rows = self.args[0]
        spec = Spec((sum(in_of),) + rows.shape[1:], rows.dtype, rows.device)
        args = (spec, list(out_of), list(in_of)) + tuple(self.args[3:])
        return Collective(self.func, args, self.kwargs, self.reverses)


class Span(TorchDispatchMode):
    """The collectives issued from the flag point that ends micro-batch `mb`'s forward to
    the next flag point; `exchanges`: that forward's (send, recv) sizes, in order."""

    def __init__(self, key: tuple, exchanges: list, watch: bool = True):
        super().__init__()
        self.key, self.exchanges, self.watch = key, exchanges, watch
        self.ops: list[Collective] = []
        self.start = issued_total()
        self.start_groups = issued_by_group()
        self.counts: Optional[dict] = None   # per group, issued since the start (ended)
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)   # counted once issued: a refused output is not
        if (self.on and getattr(func, "namespace", None) in NAMESPACES
                and func.overloadpacket.__name__ not in LOCAL_OPS):
            self.ops.append(Collective(func, _describe(args), _describe(kwargs)))
        return out

    def begin(self) -> None:
        self.on = True
        if self.watch:
            self.__enter__()

    def end(self) -> bool:
        """Stop recording; False where the span's count is not the groups' (unknown).
        An unwatched span (its key's template confirmed) only counts, per group."""
        if not self.on:
            return False
        self.on = False
        self.counts = _since(self.start_groups, issued_by_group())
        if not self.watch:
            return self.counts is not None
        if _get_current_dispatch_mode() is self:
            self.__exit__(None, None, None)
        else:
            return False   # another mode above it: not left cleanly, its count unknown
        total = issued_total()
        return total is not None and self.start is not None and total - self.start == len(
            self.ops)

    def template(self) -> Optional[list[Collective]]:
        """The span's collectives, each row all-to-all named by the forward exchange it
        reverses (the layers in reverse, a combine's reverse before its dispatch's);
        None where they do not match that order one for one."""
        expected = [(i, phase) for i in reversed(range(len(self.exchanges)))
                    for phase in ("combine", "dispatch")]
        named = []
        for op in self.ops:
            if not _sizes_known(op):
                return None
            if op.func.namespace == "_c10d_functional" and \
                    op.func.overloadpacket.__name__ == ROWS:
                if not expected:
                    return None
                op = Collective(op.func, op.args, op.kwargs, expected.pop(0))
                if op.sized(self.exchanges).key() != Collective(
                        op.func, op.args, op.kwargs).key():
                    return None
            named.append(op)
        return None if expected else named   # every exchange's reverse, or not known


def remaining(span: Span, template: Optional[list[Collective]]) -> Optional[list]:
    """What `span` (refused, its recording ended) still owes by `template`, sized by its
    own forward's exchanges; None where that is not known."""
    if template is None:
        return None
    owed = [op.sized(span.exchanges) for op in template]
    if span.watch:
        done = len(span.ops)
        if done > len(owed) or [op.key() for op in owed[:done]] != [
                op.key() for op in span.ops]:
            return None
    else:   # placed by the groups' counts alone: the template's first `done`, per group
        done = sum(span.counts.values()) if span.counts is not None else len(owed) + 1
        if done > len(owed) or per_group(owed[:done]) != span.counts:
            return None
    # A layer recomputed whole after the refusal re-runs the peers' routing and counts
    # exchange on what they receive: zeros there change their sizes (seen: a shape error
    # on the peer, "shape '[284, 1, 32]' is invalid for input of size 4064").
    if any(op.func.overloadpacket.__name__ == "alltoall_base_" for op in owed[done:]):
        return None
    return owed[done:]


def alike(template: Optional[list[Collective]], span: Span) -> bool:
    """Whether `span` (watched, ended) issued what `template` (an earlier step's span of
    the same key) made: the same ops, groups and order, the row all-to-alls sized by
    `span`'s own exchanges; each op's group known (an unwatched span is placed by them)."""
    if template is None or len(template) != len(span.ops):
        return False
    if any(group_of(op) is None for op in template):
        return False
    return [op.sized(span.exchanges).key() for op in template] == [
        op.key() for op in span.ops]


def counted_whole(span: Span, template: Optional[list[Collective]]) -> bool:
    """Whether an unwatched span (ended) issued, per group, what `template` makes."""
    return template is not None and span.counts == per_group(template)


def replay(owed: list[Collective]) -> None:
    """Each collective again, in order, with zero buffers, waited before the next, and
    let go of by the backend before the next (release.py: gloo's worker thread freed
    the zeros late otherwise)."""
    for op in owed:
        zeros = _zeros((op.args, op.kwargs))
        (args, kwargs), marks = handed(zeros)
        out, item = op.func(*args, **kwargs), None
        for item in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(item, torch.ScriptObject):
                dist.Work.unbox(item).wait()
            elif torch.is_tensor(item) and op.func.namespace.startswith("_c10d_functional"):
                torch.ops._c10d_functional.wait_tensor(item)
        del out, item, args, kwargs   # a c10d op returns the views it wrote
        let_go(marks)


def _sizes_known(op: Collective) -> bool:
    """Whether a later step makes `op` with the same sizes or with sizes this module
    derives: not an autograd all-to-all (a forward's exchange re-issued in backward), not
    a plain all-to-all with split sizes of its own (transformers' counts exchange has
    none: its (R, L) counts split evenly)."""
    if op.func.namespace == "_c10d_functional_autograd":
        return False
    if op.func.overloadpacket.__name__ == "alltoall_base_":
        return len(op.args) > 4 and not (op.args[3] or op.args[4])
    return True


def issued_total() -> Optional[int]:
    """The collectives issued on every process group of the job so far (the sum of the
    groups' sequence numbers); None where a backend does not count."""
    total = 0
    try:
        for group in dist.distributed_c10d._world.pg_map:
            total += int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None
    return total


def issued_by_group() -> Optional[dict]:
    """The collectives issued so far on each process group of the job, by group name;
    None where a backend does not count."""
    counts: dict = {}
    try:
        for group in dist.distributed_c10d._world.pg_map:
            name = group.group_name
            counts[name] = counts.get(name, 0) + int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None
    return counts


def _since(start: Optional[dict], now: Optional[dict]) -> Optional[dict]:
    """Per group, what was issued from `start` to `now` (groups with none left out);
    None where either is unknown or the groups differ."""
    if start is None or now is None or start.keys() != now.keys():
        return None
    return {name: now[name] - start[name] for name in now if now[name] != start[name]}


def group_of(op: Collective) -> Optional[str]:
    """The name of the process group `op` is issued on: its group argument (a c10d op's
    ProcessGroup, a functional collective's group name)."""
    names = {group.group_name for group in dist.distributed_c10d._world.pg_map}
    for value in list(op.args) + list(op.kwargs.values()):
        key = _key(value)
        if isinstance(key, tuple) and key[:1] == ("group",):
            return key[1]
        if isinstance(key, str) and key in names:
            return key
    return None


def per_group(ops: list[Collective]) -> dict:
    counts: dict = {}
    for name in map(group_of, ops):
        counts[name] = counts.get(name, 0) + 1
    return counts


def _describe(value):
    """`value` (an op's arguments) with each tensor as its Spec."""
    return tree_map_only(torch.Tensor, lambda t: Spec(tuple(t.shape), t.dtype, t.device), value)


def _zeros(value):
    """`value` with each Spec as a zero buffer of it."""
    return tree_map_only(Spec, lambda s: torch.zeros(s.shape, dtype=s.dtype, device=s.device),
                         value)


def _key(value):
    """A comparable form: process groups by name."""
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, torch.ScriptObject):
        try:
            return ("group", dist.ProcessGroup.unbox(value).group_name)
        except (RuntimeError, TypeError):
            return ("object",)   # a reduce op: its place in the op's schema says which
    return value
