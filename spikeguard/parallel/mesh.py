"""One device mesh for pipeline, data and expert parallelism: (pp, dp, ep).

    layout = ParallelLayout(nproc=4, pp=2, ep=2)        # dp = nproc / (pp * ep) = 1
    groups = MeshGroups.build(layout)                    # inside a process group

Rank r sits at (pp, dp, ep) = unravel(r, (PP, DP, EP)): the ep peers of a stage are
neighbours, the stages of one pipeline are NP/PP ranks apart. Groups, all from
`init_device_mesh`:
  * `pp_group`: one pipeline (the P2P sends and receives of the schedule);
  * `ep_group`: the expert-parallel peers of one stage (all-to-all dispatch and combine,
    and the guard's per-micro-batch agreement); per stage, so the collectives of
    different stages, which run different layers at different times, never mix;
  * `dp_group`: the data-parallel replicas of one (stage, ep) coordinate (expert grads);
  * `replicate_group`: dp x ep flattened, the ranks that hold the same replicated
    (non-expert) parameters of a stage: their gradients are summed over it after the
    step (PipelineRank._reduce_grads).
Every (dp, ep) coordinate reads its own data shard (`data_shard`), the same on every stage
of its pipeline (stage 0 needs the tokens, the last stage the targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spikeguard.errors import UsageError
from spikeguard.names import SCHEDULES  # noqa: F401  (the pipeline schedules, re-exported)

# Meshes built on a process group that outlives the runs (the bench's reusable worker,
# spikeguard.bench.worker), per (layout, device type): every run would otherwise create
# its subgroups again, and gloo keeps the old ones' threads and sockets (measured: 6
# threads, 8 file descriptors and ~5 MiB more per run, 300 threads after 49 runs).
# Emptied by release_shared_meshes before that group is destroyed.
_SHARED: dict = {}


def release_shared_meshes() -> None:
    _SHARED.clear()


@dataclass(frozen=True)
class ParallelLayout:
    nproc: int
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.nproc // (self.pp * self.ep)

    def check(self, *, num_layers: int, num_experts: int, micro_batches: int,
              stages_per_rank: int = 1) -> "ParallelLayout":
        """Every layout mistake, as a UsageError, before any process group starts."""
        for name, value in (("--nproc", self.nproc), ("--pp", self.pp), ("--ep", self.ep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if self.nproc % (self.pp * self.ep):
            raise UsageError(f"--pp {self.pp} x --ep {self.ep} = {self.pp * self.ep} must divide "
                             f"the number of processes {self.nproc} (data parallel is the rest)")
        if num_experts % self.ep:
            raise UsageError(f"expert-parallel size {self.ep} must divide the number of experts "
                             f"({num_experts})")
        stages = self.pp * stages_per_rank
        if num_layers % stages:
            raise UsageError(f"{stages} pipeline stages must divide the {num_layers} layers")
        if self.pp > 1 and micro_batches % self.pp:
            raise UsageError(f"--micro-batches {micro_batches} must be a multiple of --pp "
                             f"{self.pp} (the 1F1B schedules fill every stage)")
        return self

    def coords(self, rank: int) -> tuple[int, int, int]:
        ep_rank = rank % self.ep
        dp_rank = (rank // self.ep) % self.dp
        return rank // (self.ep * self.dp), dp_rank, ep_rank


@dataclass
class MeshGroups:
    layout: ParallelLayout
    mesh: object
    pp_rank: int
    dp_rank: int
    ep_rank: int
    pp_group: object
    ep_group: Optional[object]
    dp_group: Optional[object]
    replicate_group: Optional[object]

    @property
    def data_shard(self) -> int:
        return self.dp_rank * self.layout.ep + self.ep_rank

    @property
    def num_shards(self) -> int:
        return self.layout.dp * self.layout.ep

    @classmethod
    def build(cls, layout: ParallelLayout, device_type: str = "cpu", *,
              shared: bool = False) -> "MeshGroups":
        """The mesh's groups; `shared`: the one built before on this same (not owned)
        process group for this layout, if any (see _SHARED)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if shared and (layout, device_type) in _SHARED:
            return _SHARED[layout, device_type]

        if dist.get_world_size() != layout.nproc:
            raise UsageError(f"the group has {dist.get_world_size()} ranks, the layout "
                             f"{layout.nproc}")
        mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.ep),
                                mesh_dim_names=("pp", "dp", "ep"))
        pp_rank, dp_rank, ep_rank = layout.coords(dist.get_rank())
        replicate = mesh["dp", "ep"]._flatten("dp_ep") if layout.dp * layout.ep > 1 else None
        groups = cls(layout, mesh, pp_rank, dp_rank, ep_rank,
                     pp_group=mesh.get_group("pp"),
                     ep_group=mesh.get_group("ep") if layout.ep > 1 else None,
                     dp_group=mesh.get_group("dp") if layout.dp > 1 else None,
                     replicate_group=replicate.get_group() if replicate is not None else None)
        if shared:
            _SHARED[layout, device_type] = groups
        return groups
