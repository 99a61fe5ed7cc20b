"""Names of the memory policies (no torch import, so the CLI can read them cheaply).

adaptive: planned per micro-batch and operator; none: keep everything; full: recompute
every layer; experts: always recompute the expert path; offload: always offload it.
"""

POLICIES = ("adaptive", "none", "full", "experts", "offload")
