"""The hook through which an expert-parallel group agrees that a micro-batch overflowed.

Recomputing a region that contains an all-to-all re-runs a collective, so every rank of
the expert-parallel group must take the safety net's re-run together, or none. The guard
(spikeguard.runtime.net) asks this protocol once per micro-batch attempt; runtime knows no
process group (it never imports parallel): spikeguard.parallel.agreement implements it
over the group, and the block adapter that finds sharded experts builds it
(`BlockAdapter.agreement`). Without one (no expert parallelism) a rank decides alone.
"""

from __future__ import annotations

from typing import Protocol


class OverflowAgreement(Protocol):
    def any_overflowed(self, mine: bool) -> bool:
        """Whether this rank (`mine`) or any other rank of the group overflowed. Every rank
        calls it once per micro-batch attempt, whatever its policy: collectives must match."""
        ...

    def any_rank(self, mine: bool) -> bool:
        """Whether this rank's flag (`mine`) or any other rank's is set: every rank calls it
        at the same point (adaptive's whole-layer fallback, see BlockAdapter)."""
        ...
