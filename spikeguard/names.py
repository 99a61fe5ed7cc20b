"""The vocabularies a user types (pipeline schedules, skew patterns, shared-expert
policies), in one module with no torch import: the command lines offer them as choices
and the modules that implement them import them from here, so a name is written once.
(The memory policies' names are spikeguard.runtime.policies', for the same reason.)"""

SCHEDULES = ("1f1b", "interleaved")                                # PipelineRank builds them
PATTERNS = ("production", "one-hot-rank", "rotating", "burst")     # routing.skew
SHARED_POLICIES = ("keep", "recompute")                            # runtime.adapter
