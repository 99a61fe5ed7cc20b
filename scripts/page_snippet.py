"""Run the Nth ```python block of a page as written (the pages' generator quotes what it prints).

    .venv/bin/python scripts/page_snippet.py docs/hf.md 0

A page's example and the lines it quotes as the example's output must come from one run of
that very text: this runs the block's text itself, not a copy of it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: page_snippet.py PAGE N", file=sys.stderr)
        return 2
    page, index = Path(argv[0]), int(argv[1])
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    if index >= len(blocks):
        print(f"page_snippet.py: {page} has {len(blocks)} python blocks, no block {index}",
              file=sys.stderr)
        return 2
    exec(compile(blocks[index], f"{page}[python {index}]", "exec"), {"__name__": "__main__"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
