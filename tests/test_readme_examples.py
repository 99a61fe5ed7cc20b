"""Every command line README.md and docs/*.md show is run, as a real subprocess.

    .venv/bin/python -m pytest tests/test_readme_examples.py -q            # 7.5-9 min here
    .venv/bin/python -m pytest tests/test_readme_examples.py -q -m "not examples_long"  # 3.5-5

(2 cores shared with other engineers' jobs, load average 4-4.5, 2026-12-01: most of each
run is process start-up, torch's import and torchrun's, which no step cap shortens; the
examples_long ones, about half the time, are the benches and the 4-process runs.)

`extract` finds the command lines of a page: in indented and fenced code blocks (a line
ending in `\\` joined with the next, a trailing `# comment` dropped) and in inline
backticks (across line breaks), every one that starts `spikeguard `, `.venv/bin/spikeguard`,
`make `, `python -m spikeguard...`, `torchrun ` or `pip install`. Each is looked up in
EXAMPLES by its text (whitespace collapsed, `.venv/bin/` dropped): `Run` runs it, `Listed`
says why it does not run here. `test_every_command_is_run_or_listed` fails on a command
that is neither, so a new example cannot land without running (or a stated reason), and on
an entry that no page shows any more.

A command runs in a scratch folder laid out as the repo root (`.venv` linked to this
checkout's), so what it writes (`run.jsonl`, `sim.json`, `docs/img`, `docs/bench.md`)
never touches a tracked file; inputs a page shows as a block (`run.toml`,
`my_cluster.toml`) are written there from that block. `make T` runs T's recipe as
`make -n` prints it from the real Makefile (the install stamp taken as made: this venv
is the installed one). Where a command takes minutes, `cap` overrides or adds flags
(`--steps`, `--reps`), stated per entry. A command meant to fail is marked in its page by
`<!-- example: exits N -->` before it, or, for a variant a page describes in prose
("with `--policy none` the same command dies ..."), listed in VARIANTS; either is checked
for its exit code, no traceback, and the lines the page quotes. `xfail` (strict) names an
example that fails today and why, so that its fix flips it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
COMMAND = re.compile(
    r"^(?:[A-Z_]+='[^']*'\s+)?(?:\.venv/bin/)?(?:spikeguard\s|make\s|pip\s+install\s|torchrun\s"
    r"|python3?\s+-m\s+(?:spikeguard|torch\.distributed\.run))")
MARKER = re.compile(r"<!--\s*example:\s*exits\s+(\d+)\s*-->")
STAMP = ".venv/.installed"


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    command: str
    exits: Optional[int] = None     # from a `<!-- example: exits N -->` marker

    @property
    def key(self) -> str:
        return key(self.command)


def key(command: str) -> str:
    text = " ".join(command.split())
    return text[len(".venv/bin/"):] if text.startswith(".venv/bin/") else text


def _code_lines(body: list[str], first: int):
    """(line number, command) of a block's lines, continuations joined, comments dropped."""
    i = 0
    while i < len(body):
        start, text = i, body[i]
        while text.rstrip().endswith("\\") and i + 1 < len(body):
            i += 1
            text = text.rstrip()[:-1] + " " + body[i].strip()
        i += 1
        text = re.sub(r"\s+#\s.*$", "", text).strip()
        yield first + start, text


def extract(text: str, page: str = "page.md") -> list[Example]:
    """The command lines of one page, in order."""
    lines = text.split("\n")
    found, prose, exits, i = [], [], None, 0

    def take(line_no: int, command: str) -> None:
        nonlocal exits
        if COMMAND.match(command):
            found.append(Example(page, line_no, " ".join(command.split()), exits))
            exits = None

    while i < len(lines):
        line = lines[i]
        marker = MARKER.search(line)
        if marker:
            exits = int(marker.group(1))
        fence = re.match(r"^\s*```", line)
        indented = line.startswith("    ") and (i == 0 or not lines[i - 1].strip())
        if fence or indented:
            j = i + 1
            if fence:
                while j < len(lines) and not re.match(r"^\s*```", lines[j]):
                    j += 1
                body, first, i = lines[i + 1:j], i + 2, j + 1
            else:
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                body, first, i = [s[4:] for s in lines[i:j]], i + 1, j
            for line_no, command in _code_lines(body, first):
                take(line_no, command)
            continue
        prose.append((i + 1, line))
        i += 1
    # Inline code may wrap: join the prose, remembering where each line starts.
    joined, starts = "", []
    for line_no, line in prose:
        starts.append((len(joined), line_no))
        joined += line + " "
    for m in re.finditer(r"`([^`]+)`", joined):
        line_no = max(n for pos, n in starts if pos <= m.start())
        before = joined[max(0, m.start() - 200):m.start()]
        marker = MARKER.findall(before)
        exits = int(marker[-1]) if marker and before.rstrip().endswith("-->") else None
        take(line_no, m.group(1))
    return found


def page_examples() -> list[Example]:
    return [e for page in PAGES for e in extract((ROOT / page).read_text(), page)]


def page_block(page: str, contains: str) -> str:
    """The text of the code block of `page` that contains `contains` (an input file the
    page shows, written where the command expects it)."""
    text = (ROOT / page).read_text()
    for m in re.finditer(r"```\w*\n(.*?)```", text, re.S):
        if contains in m.group(1):
            return m.group(1)
    for m in re.finditer(r"(?:^|\n\n)((?:    .*\n|\n)+)", text):
        block = "\n".join(s[4:] for s in m.group(1).split("\n"))
        if contains in block:
            return block.strip("\n") + "\n"
    raise AssertionError(f"{page} has no block with {contains!r}")


from readme_examples_table import EXAMPLES, VARIANTS, Run  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.multiprocess


def unlisted(examples: list[Example]) -> list[Example]:
    """The commands of `examples` that EXAMPLES neither runs nor lists."""
    return [e for e in examples if e.key not in EXAMPLES]


def with_flags(command: str, cap: dict) -> str:
    """`command` with each flag of `cap` set to its value (replaced, given to a flag the
    page used bare, as `--scaling`, or appended)."""
    tokens = shlex.split(command)
    for flag, value in cap.items():
        if flag in tokens:
            i = tokens.index(flag) + 1
            if i < len(tokens) and not tokens[i].startswith("--"):
                tokens[i] = str(value)
            else:
                tokens.insert(i, str(value))
        else:
            tokens += [flag, str(value)]
    return shlex.join(tokens)


def make_recipe(target: str) -> list[str]:
    """The shell lines `make target` runs, from the real Makefile (install stamp as made)."""
    out = subprocess.run(["make", "-n", "-s", "-o", STAMP, target], cwd=ROOT, text=True,
                         capture_output=True, timeout=30, check=True).stdout
    return [line for line in out.replace("\\\n", " ").splitlines() if line.strip()]


def scratch_root(tmp_path: Path) -> Path:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")   # a page's `torchrun scripts/...`
    (tmp_path / "docs" / "img").mkdir(parents=True)
    return tmp_path


def run_example(command: str, spec: Run, cwd: Path) -> subprocess.CompletedProcess:
    # `spikeguard ...` without `.venv/bin/`: as a user with the venv activated runs it.
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": f"{cwd / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name, content in spec.files.items():
        path = cwd / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page_block(*content) if isinstance(content, tuple) else content)
    for setup in spec.before:
        done = subprocess.run(["bash", "-c", setup], cwd=cwd, text=True, capture_output=True,
                              timeout=spec.timeout_s, env=env)
        assert done.returncode == 0, f"{setup}\n{done.stderr[-3000:]}"
    words = command.split()
    if words[0] == "make":
        lines = make_recipe(words[1])
        assert lines, f"make {words[1]} has an empty recipe"
    else:
        lines = list(spec.runs) or [command]
    script = " && ".join(with_flags(line, spec.cap) if spec.cap else line for line in lines)
    return subprocess.run(["bash", "-c", script], cwd=cwd, text=True, capture_output=True,
                          timeout=spec.timeout_s, env=env)


def check(done: subprocess.CompletedProcess, spec: Run, exits: int) -> None:
    said = f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == exits, said
    assert "Traceback" not in done.stderr + done.stdout, said
    if spec.stderr_lines is not None:
        assert len(done.stderr.strip().splitlines()) == spec.stderr_lines, said
    for text in spec.expect:
        assert text in done.stdout + done.stderr, f"missing {text!r}\n{said}"


def _cases():
    on_pages = {e.key: e for e in reversed(page_examples())}   # the first showing of each
    cases = []
    for name, spec in EXAMPLES.items():
        if isinstance(spec, Run) and name in on_pages:
            e = on_pages[name]
            cases.append((e.command, spec, e.exits if e.exits is not None else spec.exits,
                          f"{e.page}:{e.line}"))
    for name, flags, spec in VARIANTS:
        cases.append((with_flags(name, flags), spec, spec.exits,
                      "variant " + " ".join(f"{k} {v}" for k, v in flags.items()) + " of"))
    out = []
    for name, spec, exits, where in cases:
        marks = [pytest.mark.timeout(spec.timeout_s * (2 + len(spec.before)) + 30)]
        if spec.xfail:
            marks.append(pytest.mark.xfail(reason=spec.xfail, strict=True))
        if spec.long:
            marks.append(pytest.mark.examples_long)
        out.append(pytest.param(name, spec, exits, marks=marks, id=f"{where} {key(name)[:60]}"))
    return out


@pytest.mark.parametrize("command, spec, exits", _cases())
def test_example_runs_as_the_page_says(command, spec, exits, tmp_path):
    check(run_example(command, spec, scratch_root(tmp_path)), spec, exits)
    missing = [name for name in spec.made if not (tmp_path / name).is_file()]
    assert not missing, f"the page says it writes {missing}; it did not"


def test_every_command_is_run_or_listed():
    examples = page_examples()
    missing = unlisted(examples)
    assert not missing, "commands the pages show that tests/readme_examples_table.py " \
        "neither runs nor lists:\n" + "\n".join(f"{e.page}:{e.line}: {e.command}" for e in missing)
    stale = set(EXAMPLES) - {e.key for e in examples}
    assert not stale, f"EXAMPLES entries no page shows any more: {sorted(stale)}"
    for name, _, _ in VARIANTS:
        assert isinstance(EXAMPLES.get(name), Run), f"a variant of a command not run: {name}"


def test_make_targets_run_what_the_pages_say():
    """The Makefile's recipes are the commands the pages print beside them (so a `Listed`
    entry that says "make X's recipe" is true)."""
    assert make_recipe("demo") == [".venv/bin/spikeguard demo"]
    bench = key(make_recipe("bench")[0])
    assert bench in EXAMPLES and bench in {e.key for e in page_examples()}
    bench_pp = key(make_recipe("bench-pp")[0])
    assert bench_pp in EXAMPLES and bench_pp in {e.key for e in page_examples()}


# ---- the test's own checks: no subprocess -------------------------------------------------

def test_a_renamed_flag_in_a_page_is_caught():
    readme = (ROOT / "README.md").read_text()
    assert not unlisted(extract(readme, "README.md"))
    broken = readme.replace("--budget 4MiB --policy adaptive --log run.jsonl",
                            "--budget-bytes 4MiB --policy adaptive --log run.jsonl")
    assert broken != readme
    assert [e.command for e in unlisted(extract(broken, "README.md"))] == [
        ".venv/bin/spikeguard train --preset tiny --steps 50 --budget-bytes 4MiB "
        "--policy adaptive --log run.jsonl"]


def test_extract_reads_blocks_continuations_inline_code_and_markers():
    page = "\n".join([
        "Intro `spikeguard train --preset",
        "tiny` wraps, `spikeguard: out of memory` is output, `spikeguard/files.py` a path.",
        "",
        "    .venv/bin/spikeguard train --steps 2 \\",
        "        --budget 4MiB    # a comment",
        "    step    1 | loss 5.6",
        "",
        "<!-- example: exits 3 -->",
        "```",
        "make demo",
        "```",
        "",
        "```python",
        "import spikeguard",
        "```",
    ])
    got = [(e.line, e.command, e.exits) for e in extract(page)]
    assert got == [(4, ".venv/bin/spikeguard train --steps 2 --budget 4MiB", None),
                   (10, "make demo", 3),
                   (1, "spikeguard train --preset tiny", None)]
    assert key(got[0][1]) == "spikeguard train --steps 2 --budget 4MiB"


def test_a_failing_example_fails_the_check():
    spec = Run(expect=("done:",))
    ok = subprocess.CompletedProcess([], 0, "step 1\ndone: 1 steps\n", "")
    check(ok, spec, 0)
    for bad in (subprocess.CompletedProcess([], 2, "", "spikeguard: error: unrecognized "
                                            "arguments: --budgett 4MiB\n"),
                subprocess.CompletedProcess([], 0, "step 1\n", ""),
                subprocess.CompletedProcess([], 0, "done:\n", "Traceback (most recent call")):
        with pytest.raises(AssertionError):
            check(bad, spec, 0)
    assert with_flags("spikeguard train --steps 50 --log a", {"--steps": 3, "--reps": 1}) == \
        "spikeguard train --steps 3 --log a --reps 1"
    assert with_flags("simulate --scaling --json a", {"--scaling": "128,256"}) == \
        "simulate --scaling 128,256 --json a"
