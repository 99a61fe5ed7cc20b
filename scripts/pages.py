"""The quoted outputs and figure tables of README.md and docs/*.md: generated, never typed.

    .venv/bin/python scripts/pages.py check              # pages == rendering of stored runs
    .venv/bin/python scripts/pages.py run NAME [...]     # run NAME's command, store, render
    .venv/bin/python scripts/pages.py rerun NAME [...]   # run it again, compare (no write)
    .venv/bin/python scripts/pages.py write              # re-render every page from the store
    .venv/bin/python scripts/pages.py list               # the blocks, their pages and commands

A block in a page sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`. NAME is
bound in scripts/page_blocks.py to a command and a renderer. `run` executes the command
(from the repo root, as a user would), stores what it printed (and the JSON it wrote, if
any) with the date and the machine in `docs/generated/NAME.json`, and writes the rendering into
every page that has the block. The rendering reads only that record, so a run that takes
minutes (the benches, the simulator at 12,288 devices, runtime_ratios) is checked without
running: `check` (tests/test_pages.py) fails on a page whose block differs from the
rendering of its record, on a marker without a binding and on a binding without a page.
`rerun` is the other half for blocks cheap enough to run again (tests/test_pages.py runs
those): the fresh output, rendered, must match the stored rendering once what varies run
to run is masked (timings, and what each block names) and the other numbers agree within
the block's relative tolerance (byte figures; the rest exactly, or within CROSS_CPU_TOL
where the stored run's processor is another).

Nothing is written except by `run` and `write`; `run` replaces a stored record only with
`--overwrite` (a record is the evidence of a figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "generated"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from page_blocks import BLOCKS, Block, load_record  # noqa: E402

BEGIN = re.compile(r"^<!-- generated: ([\w.-]+) -->$")
END = "<!-- end: {} -->"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?=( (?:[KMG]i)?B\b)?)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---- pages: find and replace the generated blocks -------------------------------------

def blocks_of(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, end marker line) of each generated block, 0-based; ValueError on
    a block never closed (a merge that lost a marker must not be rewritten silently)."""
    lines = text.split("\n")
    found = []
    for i, line in enumerate(lines):
        m = BEGIN.match(line.strip())
        if m:
            name = m.group(1)
            try:
                end = lines.index(END.format(name), i + 1)
            except ValueError:
                raise ValueError(f"<!-- generated: {name} --> at line {i + 1} has no "
                                 f"{END.format(name)}") from None
            found.append((name, i, end))
    return found


def content(text: str, begin: int, end: int) -> str:
    """The block's text between its markers, without the blank lines around it."""
    return "\n".join(text.split("\n")[begin + 1:end]).strip("\n")


def replace(text: str, name: str, rendered: str) -> str:
    """`text` with every block `name` holding `rendered` (one blank line each side, so an
    indented code block stays one after an HTML comment)."""
    for _, begin, end in reversed([b for b in blocks_of(text) if b[0] == name]):
        lines = text.split("\n")
        text = "\n".join(lines[:begin + 1] + ["", rendered.strip("\n"), ""] + lines[end:])
    return text


# ---- the store: one record per block's run ---------------------------------------------

def record_path(name: str) -> Path:
    return RUNS / f"{name}.json"


def load(name: str) -> dict:
    return json.loads(record_path(name).read_text(encoding="utf-8"))


def has_record(block: Block) -> bool:
    if block.source:
        return (ROOT / block.source).exists()
    return record_path(block.record or block.name).exists()


def rendering(name: str) -> str:
    block = BLOCKS[name]
    return block.render(load_record(block, load)).strip("\n")


def execute(block: Block) -> dict:
    """Run the block's command in a scratch folder laid out as the repo root (`.venv`
    linked), so a command that writes files (`--json sim.json`) touches nothing tracked;
    the record it returns is what the renderer reads."""
    with tempfile.TemporaryDirectory(prefix="pages-") as tmp:
        cwd = Path(tmp)
        (cwd / ".venv").symlink_to(ROOT / ".venv")
        for link in block.links:
            (cwd / link).parent.mkdir(parents=True, exist_ok=True)
            (cwd / link).symlink_to(ROOT / link)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PATH": f"{cwd / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        start = time.perf_counter()
        done = subprocess.run(["bash", "-c", block.command], cwd=cwd, text=True, env=env,
                              capture_output=True, timeout=block.timeout_s)
        seconds = time.perf_counter() - start
        output = None
        if block.output:
            path = cwd / block.output
            output = json.loads(path.read_text()) if path.exists() else None
    return {"name": block.name, "command": block.command, "exit": done.returncode,
            "stdout": done.stdout, "stderr": done.stderr, "output": output,
            "seconds": round(seconds, 1), "date": datetime.datetime.now(
                datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine()}


def machine() -> dict:
    """Where the figure was measured: every CPU figure says it is one (no GPU here)."""
    import torch

    return {"cpus": os.cpu_count(), "load": [round(x, 1) for x in os.getloadavg()],
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "python": platform.python_version(), "system": platform.platform(),
            "cpu": cpu_model()}


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo), or platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# A re-run on another processor than its stored run's: the losses a run prints are exact on
# one processor and torch build, not across them (the math libraries' kernels, and so the
# order of their float sums, differ by instruction set: the demo's step-30 loss was 2.837 on
# an AMD EPYC, 2.831 on an Intel Xeon, torch 2.13.0+cpu). Within this share there, exact
# on the stored run's processor.
CROSS_CPU_TOL = 0.005


def store(name: str, record: dict, overwrite: bool) -> None:
    path = record_path(name)
    if path.exists() and not overwrite:
        raise SystemExit(f"pages: {path} exists: pass --overwrite to "
                         f"replace the stored run")
    RUNS.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- whole pages a command of the project writes: checked the same way -----------------
# (page, the report it renders, its plots folder): `spikeguard bench --docs` writes them
# from the report it also writes as --json; spikeguard.bench.bench_docs renders them again.
WHOLE = (("docs/bench.md", "docs/bench.json", "docs/img/bench"),
         ("docs/bench_pp.md", "docs/bench_pp.json", "docs/img/bench_pp"))


def whole_page(page: str, report: str, plots: str) -> str:
    from spikeguard.bench.bench_docs import page as render
    from spikeguard.bench.plots import PLOT_FILES

    files = [ROOT / plots / PLOT_FILES[k] for k in ("memory", "imbalance", "throughput")
             if (ROOT / plots / PLOT_FILES[k]).exists()]   # the order run_bench writes them
    path = ROOT / page
    return render(json.loads((ROOT / report).read_text(encoding="utf-8")), files,
                  path.parent, path.name)


# ---- check, compare, write --------------------------------------------------------------

def stale() -> list[str]:
    """What `check` reports: every page block that is not its record's rendering, markers
    without a binding, bindings no page shows, records missing or failed unexpectedly."""
    problems, shown = [], set()
    for page in pages():
        found, page_problems = check_page(str(page.relative_to(ROOT)),
                                          page.read_text(encoding="utf-8"))
        shown |= found
        problems += page_problems
    for page, report, plots in WHOLE:
        if (ROOT / page).read_text(encoding="utf-8") != whole_page(page, report, plots):
            problems.append(f"{page} differs from the rendering of {report} "
                            f"(scripts/pages.py write)")
    for name in sorted(set(BLOCKS) - shown):
        problems.append(f"scripts/page_blocks.py: {name} is shown by no page")
    for name in sorted(set(BLOCKS) & shown):
        if not BLOCKS[name].source and not BLOCKS[name].record and record_path(name).exists():
            rec = load(name)
            if rec["exit"] != BLOCKS[name].exits:
                problems.append(f"docs/generated/{name}.json: exit {rec['exit']}, the block "
                                f"expects {BLOCKS[name].exits}")
    return problems


def check_page(rel: str, text: str) -> tuple[set, list[str]]:
    """The blocks one page shows, and what is wrong with them."""
    try:
        found = blocks_of(text)
    except ValueError as err:
        return set(), [f"{rel}: {err}"]
    problems = []
    for name, begin, end in found:
        if name not in BLOCKS:
            problems.append(f"{rel}:{begin + 1}: block {name!r} has no binding in "
                            f"scripts/page_blocks.py")
            continue
        block = BLOCKS[name]
        source = block.source or f"docs/generated/{block.record or name}.json"
        if not has_record(block):
            problems.append(f"{rel}:{begin + 1}: {name}: no {source} "
                            f"(scripts/pages.py run {block.record or name})")
        elif content(text, begin, end) != rendering(name):
            problems.append(f"{rel}:{begin + 1}: {name} differs from the rendering of "
                            f"{source} (scripts/pages.py write)")
    return {name for name, _, _ in found}, problems


def skeleton(text: str, block: Block) -> tuple[str, list[tuple[float, bool]]]:
    """The text with what varies masked and every other number taken out (as '#'), and
    those numbers, each with whether it is a byte figure (followed by B/KiB/MiB/GiB): two
    renderings agree when skeletons are equal, byte figures within the block's tolerance
    and every other number (losses, counts, steps) exactly."""
    for pattern in block.masks:
        text = re.sub(pattern, "<varies>", text)
    numbers = [(float(m.group(0).replace(",", "")), m.group(1) is not None)
               for m in NUMBER.finditer(text)]
    return NUMBER.sub("#", text), numbers


def differences(stored: str, fresh: str, block: Block, same_cpu: bool = True) -> list[str]:
    """Why `fresh` does not match `stored` under the block's tolerance ([] if it does);
    `same_cpu` False: the other numbers within CROSS_CPU_TOL rather than exactly."""
    a, b = skeleton(stored, block), skeleton(fresh, block)
    if a[0] != b[0]:
        return [f"text differs:\n--- stored\n{stored}\n--- fresh\n{fresh}"]
    out = []
    for (x, is_bytes), (y, _) in zip(a[1], b[1]):
        tol = block.bytes_tol if is_bytes else 0.0 if same_cpu else CROSS_CPU_TOL
        if abs(x - y) > tol * max(abs(x), abs(y)):
            out.append(f"{x:g} -> {y:g} (tolerance {tol:.1%})")
    return out


def rerun(name: str) -> list[str]:
    """Run `name` again and compare its rendering with the stored one's (nothing written)."""
    block = BLOCKS[name]
    fresh = execute(block)
    if fresh["exit"] != block.exits:
        return [f"{name}: exit {fresh['exit']} (expected {block.exits})\n{fresh['stderr'][-2000:]}"]
    stored = load(name)
    same_cpu = stored["machine"].get("cpu") == fresh["machine"]["cpu"]
    return [f"{name}: {d}" for d in differences(block.stable(stored), block.stable(fresh),
                                                block, same_cpu)]


def write(names=None) -> list[Path]:
    """Render the named blocks (all by default) into every page that shows them."""
    changed = []
    for page, report, plots in WHOLE if names is None else ():
        text = whole_page(page, report, plots)
        if (ROOT / page).read_text(encoding="utf-8") != text:
            (ROOT / page).write_text(text, encoding="utf-8")
            changed.append(ROOT / page)
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = text
        for name, _, _ in blocks_of(text):
            if (names is None or name in names) and name in BLOCKS and has_record(BLOCKS[name]):
                new = replace(new, name, rendering(name))
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("check", "run", "rerun", "write", "list"))
    p.add_argument("names", nargs="*")
    p.add_argument("--overwrite", action="store_true", help="run: replace a stored record")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BLOCKS]
    if unknown:
        p.error(f"no block named {', '.join(unknown)} (scripts/pages.py list)")
    if args.mode == "list":
        for block in BLOCKS.values():
            print(f"{block.name:18} {'re-run' if block.rerun else 'stored':7} {block.command}")
        return 0
    if args.mode == "check":
        problems = stale()
        print("\n".join(problems) or f"pages: {len(BLOCKS)} generated blocks up to date")
        return 1 if problems else 0
    if args.mode == "rerun":
        names = args.names or [b for b in BLOCKS if BLOCKS[b].rerun]
        problems = [d for n in names for d in rerun(n)]
        print("\n".join(problems) or "pages: the re-runs match the stored runs")
        return 1 if problems else 0
    if args.mode == "run":
        for name in args.names or p.error("run: name the blocks to run"):
            if BLOCKS[name].source:
                p.error(f"{name} renders {BLOCKS[name].source}, which `{BLOCKS[name].command}` "
                        f"writes: run that, then `scripts/pages.py write {name}`")
            if BLOCKS[name].record:
                p.error(f"{name} renders the run of {BLOCKS[name].record}: run that")
            if record_path(name).exists() and not args.overwrite:
                p.error(f"docs/generated/{name}.json exists: pass --overwrite to replace it")
            record = execute(BLOCKS[name])
            print(f"{name}: exit {record['exit']} in {record['seconds']} s")
            if record["exit"] != BLOCKS[name].exits:
                print(record["stderr"][-3000:], file=sys.stderr)
                return 1
            store(name, record, args.overwrite)
    for page in write(args.names or None):
        print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
