"""The EP case that tests' spawned ranks share: seeds, the `ExpertParallel` layout, each
rank's micro-batches and its all-saved probe (importable by the children, as `meter`).
Used by tests/runtime/entry_exchange_workers.py and tests/bench/oracle_ep_workers.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spikeguard.bench import oracle_bench
from spikeguard.bench.oracle_ep import ExpertParallel
from spikeguard.data.corpus import load_corpus
from spikeguard.model import model_config


@dataclass(frozen=True, kw_only=True)
class EPCase:
    cfg: object
    layout: ExpertParallel
    batches: list
    peak: int     # this rank's true all-saved peak (oracle_bench.probe)
    seen: object  # what the probe recorded, for oracle_bench.oracle_problems


def ep_case(rank: int, preset: str, num_micro_batches: int = 2, **overrides) -> EPCase:
    """`preset` with `overrides` over the whole world (model seed 0), 8-sequence
    micro-batches of this rank's own data (generator seeded 1000 * rank, as oracle_ep),
    probed all-saved under the layout."""
    torch.manual_seed(0)
    cfg = model_config(preset, **overrides)
    layout = ExpertParallel(cfg, 0, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1000 * rank)
    corpus = load_corpus(None)
    batches = [corpus.get_batch("train", 8, cfg.seq_len, gen) for _ in range(num_micro_batches)]
    peak, seen = oracle_bench.probe(cfg, 0, batches, layout)
    return EPCase(cfg=cfg, layout=layout, batches=batches, peak=peak, seen=seen)
