"""What the pages' generated blocks share (scripts/page_blocks.py, scripts/page_tables.py):
the Block binding, the example-run note, and the command lines two modules quote."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = (r"\d[\d.]*[kMG]? tok/s", r"in \d[\d.]* s\b")
EP = (".venv/bin/spikeguard train --preset tiny --num-experts 8 --nproc 2 --steps 6 "
      "--batch-size 8 --skew one-hot-rank --spike-prob 0.5 --spike-max 2 --budget auto")
PP = (".venv/bin/spikeguard train --preset tiny --num-layers 4 --num-experts 8 --nproc 4 "
      "--pp 2 --ep 2 --micro-batches 4 --batch-size 2 --steps 3 --threads 1 --skew one-hot-rank "
      "--spike-prob 1 --spike-max 2 --budget 1.5MiB --policy adaptive")


@dataclass(frozen=True)
class Block:
    """One generated block: `command` (run from the repo root, as the page shows it),
    `render(record) -> text`, `stable(record) -> text` compared by a re-run (None: not
    re-run by the suite; its figures vary, or it takes minutes), its expected exit code."""
    name: str
    command: str
    render: Callable[[dict], str]
    stable: Optional[Callable[[dict], str]] = None
    exits: int = 0
    output: str = ""          # a JSON file the command writes, stored in the record
    source: str = ""          # a tracked JSON the command writes itself (not re-run here)
    masks: tuple = TIMINGS
    bytes_tol: float = 0.0    # relative tolerance of figures in B/KiB/MiB/GiB in a re-run
    timeout_s: int = 900
    long: bool = False        # its re-run takes most of a minute or more on this machine
    links: tuple = ()         # repo paths the command reads, linked into its scratch folder
    record: str = ""          # another block's stored run, rendered differently here

    @property
    def rerun(self) -> bool:
        return self.stable is not None


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _indented(lines: list[str]) -> str:
    return "\n".join("    " + line for line in lines)


def _example(record: dict, varies: str) -> str:
    """The note under an example run: when and where it ran, and what varies."""
    m = record["machine"]
    return (f"(an example run, {record['date']}, {record['seconds']:g} s, on {m['cpus']} "
            f"shared CPU cores at load {m['load'][0]:g}: CPU figures, emulated device; "
            f"{varies})")
