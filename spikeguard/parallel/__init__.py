"""Parallelism applied to a finished model from outside: expert parallelism (all-to-all)."""

from spikeguard.parallel.expert_parallel import (ExpertParallelDispatched,
                                                 ExpertParallelDispatcher,
                                                 allreduce_replicated_grads, expert_parameters,
                                                 parallelize_experts)

__all__ = ["ExpertParallelDispatched", "ExpertParallelDispatcher", "allreduce_replicated_grads",
           "expert_parameters", "parallelize_experts"]
