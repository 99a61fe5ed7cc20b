"""What each generated block of the pages is: a command and a renderer (scripts/pages.py).

A renderer reads only the stored record (docs/generated/NAME.json: the command's stdout,
stderr, the JSON it wrote, the date and the machine), or a tracked JSON a command of the
project writes itself (`source`: docs/bench.json by `make bench`), so a block is its run's
text, formatted, never computed anew. `stable` is what a re-run must reproduce (the losses
of a fixed seed are bitwise the same under every policy; bytes move by a fraction of a MiB
with gloo's buffers, hence `bytes_tol`); `masks` hide what varies by nature (timings).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from page_common import (EP, PP, ROOT, TIMINGS, Block, _example, _indented,  # noqa: F401
                         _lines)


def _moved(line: str) -> bool:
    """A step line where the guard did something beyond saving everything."""
    if not line.startswith("step "):
        return False
    counts = re.search(r"rec ([\d+]+) off ([\d+]+)", line)
    moved = counts and any(int(n) for part in counts.groups() for n in part.split("+"))
    return bool(moved or "| evict " in line)


def _train_block(record: dict, varies: str) -> str:
    """The auto-budget line, every step line where the guard moved something, the summary
    and the closing line: the lines of a run that say what the guard did."""
    out = [line for line in _lines(record["stdout"])
           if line.startswith(("memory: budget auto", "memory: peak", "done: ")) or _moved(line)]
    return _indented(out) + "\n\n" + _example(record, varies)


def _whole_run(record: dict) -> str:
    """Every line of a short run but the data's path (this machine's): what the model
    is, the budget, the guard, each step and the net's re-runs, the summary."""
    out = [line for line in _lines(record["stdout"]) + _lines(record["stderr"])
           if not line.startswith(("data: ", "memory: CPU run"))]
    return _indented(out) + "\n\n" + _example(record, VARIES)


def _stable_train(record: dict) -> str:
    return "\n".join(line for line in _lines(record["stdout"])
                     if line.startswith(("memory: budget auto", "done: ")))


def _last_lines(record: dict) -> str:
    """A run's last step line, its memory summary and its closing line."""
    lines = _lines(record["stdout"])
    steps = [line for line in lines if line.startswith("step ")]
    out = steps[-1:] + [line for line in lines if line.startswith(("memory: peak", "done: "))]
    return _indented(out) + "\n\n" + _example(record, "the timings vary run to run")


def _stable_last(record: dict) -> str:
    return "\n".join(line for line in _lines(record["stdout"])
                     if line.startswith(("memory: peak", "done: ")))


def _stderr_lines(record: dict) -> str:
    return _indented(_lines(record["stderr"]))


def _died(record: dict) -> str:
    return _stderr_lines(record) + "\n\n" + _example(
        record, "whether it is the head's forward or backward, and the allocation's size, "
        "vary run to run: gloo sometimes still holds an all-to-all's rows at the peak")


# ---- tables from the benches' JSON -------------------------------------------------------

def _bench_table(report: dict) -> str:
    from spikeguard.bench.table import table_header, table_rows

    header = table_header(report)
    return "\n".join(["| " + " | ".join(header) + " |",
                      "|" + "|".join("---" for _ in header) + "|",
                      *("| " + " | ".join(row) + " |" for row in table_rows(report))])


def _bench_note(report: dict) -> str:
    m = report["machine"]
    return (f"(`{report['command']}`, {report['date']}, {m['cpus']} CPUs, load "
            f"{m['load_average'][0]:g} at the start and {m['load_average'][-1]:g} at the end: "
            f"CPU figures, emulated device; `-` in `evicted`: the report predates the column)"
            if not any("evicted_bytes" in f for f in report["policies"].values()) else
            f"(`{report['command']}`, {report['date']}, {m['cpus']} CPUs, load "
            f"{m['load_average'][0]:g} at the start and {m['load_average'][-1]:g} at the end: "
            f"CPU figures, emulated device)")


def bench_readme(record: dict) -> str:
    return _bench_table(record) + "\n\n" + _bench_note(record)


def bench_output(record: dict) -> str:
    """A bench run by the pages (its JSON stored in the record, not tracked)."""
    return bench_readme(record["output"])


LATE = (".venv/bin/spikeguard bench --steps 80 --segments 4 --spike-prob 0.1 "
        "--budget 114MiB")


def runtime_ratios(record: dict) -> str:
    from spikeguard.bench.native_rows import ran_out
    from spikeguard.bench.runtime_ratios import decision_cells
    from spikeguard.bench.spread import cell, needed
    from spikeguard.memory.budget import format_bytes

    r = record["output"]
    ceiling = r["policies"]["ceiling"]["tokens_per_s"]
    spread = all("vs_ceiling" in p for p in r["policies"].values())   # per-round ratios
    rows = ["| policy (`%s`, CPU, emulated device) | tokens/s | vs ceiling | %speak / budget | "
            "overruns | save / recompute / offload (last step) | evicted (last step) |"
            % (r["preset"], "rounds for +-0.01 | " if spread else ""),
            "|---|---|---|---|---|---|---|" + ("---|" if spread else "")]
    for name, p in r["policies"].items():
        budget = "none" if name == "ceiling" else format_bytes(r["budget_bytes"])
        ratio = f"{p['tokens_per_s'] / ceiling:.3f} | "
        if spread:
            n = "-" if name == "ceiling" else needed(p["vs_ceiling"])
            ratio = f"{cell(p['vs_ceiling'])} | {n} | "
        if ran_out(p):   # PyTorch's own rows have no safety net: on a device, it ran out
            ratio = "ran out | " + ("- | " if spread else "")
        rows.append(f"| {name} | {p['tokens_per_s']:.0f} | {ratio}"
                    f"{format_bytes(p['peak_bytes'])} / {budget} | {p['overruns']} | "
                    f"{' | '.join(decision_cells(p))} |")
    return ("\n".join(rows) + f"\n\nadaptive/ceiling {r['adaptive_over_ceiling']:.3f}, "
            f"full/ceiling {r['full_over_ceiling']:.3f}: adaptive closes "
            f"{r['gap_closed']:.0%} of the gap; "
            + ("per-round ratios, the median (quartiles) of " if spread else "medians of ")
            + f"{r['reps']}, budget "
            f"{r['budget_bytes'] / r['ceiling_peak_bytes']:.2f}x the ceiling's true peak"
            + ("; checkpoint (`torch.utils.checkpoint` per block) and save_on_cpu: PyTorch's "
               "own, unguarded (spikeguard/bench/native_rows.py)"
               if any(p.get("native") for p in r["policies"].values()) else "") + ". "
            + _example(record, "read the ratios as +-0.03"))


def oracle_bench(record: dict) -> str:
    from spikeguard.bench.oracle_bench import table_lines

    return ("\n".join(table_lines(record["output"])).strip() + "\n\n"
            + _example(record, "read the ratios with their ranges; which operator moves "
                       "follows the cost model's timings"))


def oracle_ep(record: dict) -> str:
    from spikeguard.bench.oracle_ep import table_lines

    return ("\n".join(table_lines(record["output"])).strip() + "\n\n"
            + _example(record, "2 gloo ranks on the same cores; read the ratios with their "
                       "ranges; which operator moves follows the cost model's timings"))


PUBLISHED = {"ceiling": "", "none": "30%, crashing", "full": "24.6%", "adaptive":
             "32.9% average, 35% best"}   # the production run's figures (DESIGN.md), quoted


def _sim_rows(record: dict) -> list[tuple[str, dict]]:
    """(label, figures) per policy of `simulate --json`, in its order."""
    out = []
    for name, p in record["output"]["policies"].items():
        label = {"none": "`none` (aggressive static)", "ceiling": "ceiling (no limit)",
                 "safe-static": f"`safe-static` (= `{p.get('setting')}`)"}.get(name, f"`{name}`")
        out.append((label, {**p, "name": name}))
    return out


def _gb(p: dict) -> str:
    peak = max(p["peak_bytes"]) / 1e9
    return f"{peak:.1f} GB" + (" at the crash" if p["crashes"] else "")


def _mfu(p: dict) -> str:
    return f"{p['mfu']:.1%}" + (" (fitted)" if p["name"] == "full" else "")


def sim_readme(record: dict) -> str:
    rows = ["| policy (`1t`, 12,288 devices, simulated) | MFU | crashes | lost s | worst peak | "
            "published |", "|---|---|---|---|---|---|"]
    for label, p in _sim_rows(record):
        rows.append(f"| {label} | {_mfu(p)} | {p['crashes']} | {p['lost_seconds']:,.0f} | "
                    f"{_gb(p)} | {PUBLISHED.get(p['name'], '')} |")
    return "\n".join(rows) + "\n\n" + _sim_note(record)


def sim_docs(record: dict) -> str:
    rows = ["| policy | MFU | tokens/s | PFLOP/s | crashes | lost s | worst peak | published |",
            "|---|---|---|---|---|---|---|---|"]
    for label, p in _sim_rows(record):
        rows.append(f"| {label} | {_mfu(p)} | {p['tokens_per_s'] / 1e6:.2f}M | "
                    f"{p['flops_per_s'] / 1e15:,.0f} | {p['crashes']} | "
                    f"{p['lost_seconds']:,.0f} | {_gb(p)} | {PUBLISHED.get(p['name'], '')} |")
    return "\n".join(rows) + "\n\n" + _sim_note(record)


def _sim_note(record: dict) -> str:
    cal = record["output"]["calibration"]
    out = record["output"]
    return (f"(`{record['command'].removeprefix('.venv/bin/spikeguard ')}`, {record['date']}: "
            f"simulated, deterministic; {out['config']['workload']['steps']:,} steps, "
            f"{out['spike_steps']} of them spike steps; kernel efficiency "
            f"{cal['efficiency']:.4f} fitted so that `full` gives {cal['target_mfu']:.1%}, the "
            f"only fitted number)")


def stdout_block(varies: str) -> Callable[[dict], str]:
    """The command's whole output, as printed, and when and where it ran."""
    return lambda record: _indented(record["stdout"].rstrip("\n").split("\n")) + "\n\n" + \
        _example(record, varies)


def recovery_table(record: dict) -> str:
    """The table scripts/recovery_table.py prints (markdown), and when it ran."""
    return "\n".join(line for line in _lines(record["stdout"]) if line.startswith("|")) + \
        "\n\n" + _example(record, "the true peaks move by a few KiB, the re-runs and the "
                               "bitwise gradients do not")


def titan_ratios(record: dict) -> str:
    """The table titan_ratios prints (markdown already), its budget line above it."""
    lines = _lines(record["stdout"])
    return "\n".join([line for line in lines if line.startswith("budget ")] + [""]
                     + [line for line in lines if line.startswith("|")]) + "\n\n" + \
        _example(record, "read the wall-clock ratios as +-0.1, the CPU column by its interval")


def _from_json(path: str) -> Callable[[dict], str]:
    return lambda record: json.loads((ROOT / path).read_text())


SIM = ".venv/bin/spikeguard simulate --preset 1t --calibrate-mfu 0.246 --json sim.json"
SIM_DOCS = (".venv/bin/spikeguard simulate --preset 1t --calibrate-mfu 0.246 --scaling "
            "--scaling-steps 300 --json sim.json")   # docs/simulator.md's command, its run
ORACLE = (".venv/bin/python -m spikeguard.bench.oracle_bench --preset small --reps 11 "
          "--json oracle.json")
ORACLE_EP = (".venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 "
             "-m spikeguard.bench.oracle_ep")
VARIES = "which operator moves, and how much is evicted, follow the cost model's timings"

_BLOCKS = [
    Block("demo", ".venv/bin/spikeguard demo",
          lambda r: _train_block(r, VARIES + "; the peaks move by a fraction of a MiB"),
          stable=_stable_train, bytes_tol=0.02, long=True),
    Block("tiny-4mib", ".venv/bin/spikeguard train --preset tiny --steps 50 --budget 4MiB "
          "--policy adaptive --log run.jsonl", _last_lines, stable=_stable_last,
          bytes_tol=0.02, long=True),
    Block("hf-qwen3", ".venv/bin/spikeguard train --hf qwen3_moe --steps 10 --eval-every 5 "
          "--threads 1", _whole_run, stable=_stable_train, bytes_tol=0.02, long=True),
    Block("hf-ep", ".venv/bin/spikeguard train --hf qwen3_moe --nproc 2 --ep 2 --steps 10 "
          "--threads 1", _whole_run, stable=_stable_train, bytes_tol=0.03, long=True),
    Block("ep-adaptive", EP + " --policy adaptive", lambda r: _train_block(r, VARIES),
          stable=_stable_train, bytes_tol=0.03, long=True),
    # forward or backward of the head, and the allocation's size, run to run
    Block("ep-none", EP + " --policy none", _died, stable=_stderr_lines, exits=3,
          masks=TIMINGS + (r"\b(?:forward|backward)\b",), bytes_tol=0.1, long=True),
    Block("pp-adaptive", PP, lambda r: _train_block(r, VARIES)),
    Block("bench", "make bench", bench_readme, source="docs/bench.json"),
    # spikes that start mid-depth, beside the same trace's spikes in every layer
    Block("bench-late", LATE + " --spike-from-layer 2 --json bench.json", bench_output,
          output="bench.json", timeout_s=1200),
    Block("bench-late-every", LATE + " --json bench.json", bench_output, output="bench.json",
          timeout_s=1200),
    Block("bench-pp", "make bench-pp", bench_readme, source="docs/bench_pp.json"),
    Block("sim-1t", SIM, sim_readme, output="sim.json", timeout_s=1200),
    Block("sim-1t-docs", SIM_DOCS, sim_docs, output="sim.json", record="sim-scaling"),
    Block("titan-ratios", ".venv/bin/python -m spikeguard.bench.titan_ratios --reps 21 --steps 8",
          titan_ratios, timeout_s=1200),
    Block("decision-time", ".venv/bin/python -m spikeguard.plan.room",
          stdout_block("timings, the p90 tail most, follow the machine's load")),
    Block("recovery", ".venv/bin/python scripts/recovery_table.py", recovery_table,
          timeout_s=1800, links=("scripts", "tests")),
    Block("runtime-ratios", ".venv/bin/python -m spikeguard.bench.runtime_ratios --preset small "
          "--reps 15 --json ratios.json", runtime_ratios, output="ratios.json", timeout_s=1800),
    Block("oracle-small", ORACLE, oracle_bench, output="oracle.json", timeout_s=3000),
    Block("oracle-medium", ".venv/bin/python -m spikeguard.bench.oracle_bench --preset medium "
          "--batch-size 4 --reps 3 --json oracle.json", oracle_bench, output="oracle.json",
          timeout_s=3600),
    Block("oracle-ep-small", ORACLE_EP + " --preset small --reps 11 --json oracle.json",
          oracle_ep, output="oracle.json", timeout_s=3000),
    Block("oracle-ep-medium", ORACLE_EP + " --preset medium --batch-size 4 --reps 2 "
          "--json oracle.json", oracle_ep, output="oracle.json", timeout_s=3600),
    Block("titan-loss-outside", ".venv/bin/spikeguard train --titan deepseek_v3 --steps 6 "
          "--policy adaptive --budget 15666016", _last_lines, timeout_s=600),
]
from page_tables import MORE  # noqa: E402  (its renderers use the helpers above)

BLOCKS = {b.name: b for b in _BLOCKS + MORE}


def load_record(block: Block, load: Callable[[str], dict]) -> dict:
    """The record a block renders: its tracked source JSON, or its stored run."""
    return _from_json(block.source)(None) if block.source else load(block.record or block.name)
