"""Training: the loop (AdamW, micro-batches, validation) and its step log."""

from spikeguard.train.log import (
    check_log_path, format_bytes, format_rate, open_log, step_line, write_record,
)
from spikeguard.train.loop import (
    GuardFactory, TrainConfig, evaluate, expert_imbalance, make_optimizer, summarize, train,
)

__all__ = [
    "GuardFactory", "TrainConfig", "evaluate", "expert_imbalance", "make_optimizer", "summarize",
    "train", "check_log_path", "format_bytes", "format_rate", "open_log", "step_line",
    "write_record",
]
