"""The generated blocks of the pages beyond the quoted runs of scripts/page_blocks.py: the
simulator's tables, the Hugging Face benches, the calm-step overhead, the examples' printed
lines and the `--policy none` lines quoted inline, and the prose figures of the bench pages.

Each renderer reads only its record (docs/generated/NAME.json) or a bench's tracked JSON,
as in page_blocks.py; a sentence that compares two figures says what the record shows
(above / below), so the prose cannot contradict the run it quotes.
"""

from __future__ import annotations

import ast
import json
import re
import statistics

from page_common import PP, ROOT, TIMINGS, Block, _example, _indented, _lines  # noqa: F401

HF = ".venv/bin/spikeguard train --hf qwen3_moe --steps 10 --eval-every 5 --threads 1"
HF_EP = ".venv/bin/spikeguard train --hf qwen3_moe --nproc 2 --ep 2 --steps 10 --threads 1"
SIM_SCALING = (".venv/bin/spikeguard simulate --preset 1t --calibrate-mfu 0.246 --scaling "
               "--scaling-steps 300 --json sim.json")
SIM_188B = (".venv/bin/spikeguard simulate --preset 188b --efficiency 0.609 --scaling "
            "--steps 300 --scaling-steps 300 --json sim.json")
PRESETS = ("188b", "500b", "1t")
SIM_PRESETS = ("for p in 188b 500b 1t; do .venv/bin/spikeguard simulate --preset $p "
               "--efficiency 0.609 --json $p.json || exit 1; done; .venv/bin/python -c "
               "'import json; json.dump({p: json.load(open(p + \".json\")) for p in "
               "(\"188b\", \"500b\", \"1t\")}, open(\"presets.json\", \"w\"))'")
VALIDATE = ".venv/bin/python -m spikeguard.sim.validate --steps 3 --reps 15 --pp-ep"
SIM_SPEED = ".venv/bin/python -m spikeguard.sim.bench --reps 3 --before /tmp/sim-before"
HF_MODELS = ("mixtral", "qwen3_moe", "olmoe")
HF_BENCH = ("for m in mixtral qwen3_moe olmoe; do .venv/bin/python -m spikeguard.bench.hf_bench "
            "--hf $m --reps 11 || exit 1; done")
HF_BENCH_EP = (".venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 "
               "-m spikeguard.bench.hf_bench --hf qwen3_moe --ep 2 --reps 15")
TRAINER = ".venv/bin/python -m spikeguard.bench.trainer_bench --reps 5"
TRAINER_EP = (".venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 -m "
              "spikeguard.bench.trainer_bench --reps 3 --ep 2")
CALM = ".venv/bin/python scripts/calm_overhead.py --reps 150 --clock cpu"
CALM_EP = ".venv/bin/torchrun --nproc-per-node 2 scripts/calm_overhead.py --reps 100 --clock cpu"
CALM_HF = ".venv/bin/python scripts/calm_overhead.py --hf qwen3_moe --reps 150 --clock cpu"
CALM_PP = (".venv/bin/torchrun --nproc-per-node 4 scripts/calm_overhead_pp.py --reps 60 "
           "--clock cpu --budget-factor 1.25")
CALM_TITAN = (".venv/bin/python scripts/calm_overhead.py --titan deepseek_v3 --reps 150 "
              "--clock cpu")
CALM_TITAN_EP = (".venv/bin/torchrun --nproc-per-node 2 scripts/calm_overhead.py --titan "
                 "deepseek_v3 --reps 100 --clock cpu")
CALM_TITAN_FSDP = (".venv/bin/torchrun --nproc-per-node 1 scripts/calm_overhead.py --titan "
                   "deepseek_v3 --fsdp --reps 100 --clock cpu --budget-factor 1.25")
FLAG_COST = ("for n in 2 4; do .venv/bin/torchrun --nproc-per-node $n scripts/flag_point_cost.py "
             "--reps 40 || exit 1; done")
CALM_HF_EP = (".venv/bin/torchrun --nproc-per-node 2 scripts/calm_overhead.py --hf qwen3_moe "
              "--reps 100 --clock cpu")


def _raw(record: dict) -> str:
    return _indented(_lines(record["stdout"]) + _lines(record["stderr"]))




# ---- the bench pages' prose: what the table's run shows, in words ----------------------

def _than(a: float, b: float, spread_a=None, spread_b=None) -> str:
    """'above' / 'below' / 'level with' a figure, or 'within the spread of' when the two
    segment spreads overlap (a ratio the machine's noise cannot order)."""
    if spread_a and spread_b and spread_a[0] <= spread_b[1] and spread_b[0] <= spread_a[1]:
        return "within the spread of"
    return "above" if a > b else "below" if a < b else "level with"


def _spread(p: dict):
    r = p.get("segment_ratios") or []
    return (min(r), max(r)) if r else None


def _decided(p: dict) -> tuple[int, int, int, int]:
    d = p["decisions"]
    save, rec, off = d.get("save", 0), d.get("recompute", 0), d.get("offload", 0)
    return save, rec, off, save + rec + off


def bench_prose(report: dict) -> str:
    """The EP bench's paragraph: adaptive against the fastest surviving static setting and
    against `none` with its crashes counted, the trace's spikes and the budget."""
    pol = report["policies"]
    a, n, c = pol["adaptive"], pol["none"], pol["ceiling"]
    setting = pol.get("safe-static", {}).get("is")   # the fastest static that survived
    save, rec, off, total = _decided(a)
    spikes = report["workload"]["spike_steps"]
    out = [f"Every ratio is a ratio of totals: the policy's tok/s over the ceiling's "
           f"({a['tokens_per_s']:.0f} / {c['tokens_per_s']:.0f} = "
           f"{a['relative_to_ceiling']:.3f} for adaptive), the effective ones its tokens over "
           f"training plus lost time, over the ceiling's tok/s; in brackets the lowest and "
           f"highest segment's ratio.",
           f"In this run adaptive had {a['overruns']} overruns, {a['restarts']} restarts and "
           f"{a['safety_net_reruns']} safety-net re-runs, and saved on {save} of {total} "
           f"operator decisions ({rec} recomputed, {off} offloaded)."]
    if setting is None:
        out.append("No static setting survived the whole trace.")
    elif setting != "none":
        s = pol[setting]
        out.append(f"The fastest static setting that survived is `{setting}` at "
                   f"{s['relative_to_ceiling']:.3f}: adaptive's {a['relative_to_ceiling']:.3f} is "
                   f"{_than(a['relative_to_ceiling'], s['relative_to_ceiling'], _spread(a), _spread(s))}"
                   f" it.")
    out.append(f"`none` ran out of memory {n['oom_events']} time(s) and was restarted "
               f"{n['restarts']} time(s): {n['effective_relative_to_ceiling']:.3f} effective, "
               f"{n['relative_to_ceiling']:.3f} on its steps alone, which is "
               f"{_than(n['relative_to_ceiling'], a['relative_to_ceiling'], _spread(n), _spread(a))}"
               f" adaptive's.")
    out.append(f"The trace has {len(spikes)} spike steps ({', '.join(map(str, spikes))}). "
               f"The budget (`--budget auto`): {report['budget_rule'].removeprefix('auto: ')}. "
               f"The run made {report['jobs']} jobs on {len(report['worker_startups_s'])} worker "
               f"start-ups ({', '.join(f'{s:.1f}' for s in report['worker_startups_s'])} s).")
    return "\n".join(out)


def bench_pp_prose(report: dict) -> str:
    """The PP bench's paragraph: whether a spike overflowed, adaptive's decisions, adaptive
    against `none` with the spreads."""
    pol = report["policies"]
    a, n = pol["adaptive"], pol["none"]
    save, rec, off, total = _decided(a)
    spikes = report["workload"]["spike_steps"]
    crashed = sum(p["oom_events"] for k, p in pol.items() if k != "ceiling")
    sa, sn = _spread(a), _spread(n)
    setting = pol.get("safe-static", {}).get("is")
    out = [f"This trace has {len(spikes)} spike steps ({', '.join(map(str, spikes))}); "
           + (f"static policies ran out of memory {crashed} time(s) in all."
              if crashed else "none of them overflowed the budget, so nothing crashed.")
           + (f" The fastest static setting over the whole trace was `{setting}`"
              + (" (the machine's load moved between segments: every static setting "
                 "survived, and on a quiet machine `none`, which saves everything, is "
                 "the fastest of them)." if setting != "none" and not crashed else ".")
              if setting else ""),
           f"Adaptive made {save} saves, {rec} recomputes and {off} offloads of {total} "
           f"decisions, with {a['overruns']} overruns and {a['safety_net_reruns']} safety-net "
           f"re-runs. Its {a['relative_to_ceiling']:.3f} of the ceiling is "
           f"{_than(a['relative_to_ceiling'], n['relative_to_ceiling'], sa, sn)} `none`'s "
           f"{n['relative_to_ceiling']:.3f}"
           + (f" ({sa[0]:.2f}-{sa[1]:.2f} against {sn[0]:.2f}-{sn[1]:.2f})." if sa and sn else "."),
           f"The budget (`--budget auto`, per rank): "
           f"{report['budget_rule'].removeprefix('auto: ')}; {report['jobs']} jobs on "
           f"{len(report['worker_startups_s'])} worker start-up(s) "
           f"({', '.join(f'{s:.1f}' for s in report['worker_startups_s'])} s)."]
    return "\n".join(out)


# ---- the simulator's tables (docs/simulator.md) -----------------------------------------

SCALING_POLICIES = ("ceiling", "none", "experts", "offload", "full", "safe-static", "adaptive")


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _gb(num_bytes: float) -> str:
    """Decimal GB or TB, as the simulator's device sizes are given (64e9)."""
    return f"{num_bytes / 1e12:,.1f} TB" if num_bytes >= 1e12 else f"{num_bytes / 1e9:,.1f} GB"


def _sim_run_note(record: dict, what: str) -> str:
    return f"({what}, {record['date']}: simulated, deterministic)"


def _scaling_rows(rows: list[dict], policies) -> list[str]:
    out = []
    for row in rows:
        if "error" in row:
            out.append(f"| {row['devices']:,} | {row['error']} |" + " |" * (len(policies) - 1))
            continue
        p = row["policies"]
        cells = []
        for name in policies:
            f = p.get(name)
            cells.append("" if f is None else _pct(f["mfu"]) +
                         (f" ({f['crashes']} crashes)" if f["crashes"] else ""))
        out.append(f"| {row['devices']:,} | " + " | ".join(cells) + " |")
    return out


def sim_scaling(record: dict) -> str:
    """`--scaling`'s table (MFU per device count), crashes beside a policy that had any,
    and where adaptive stands against full recompute at the smallest count that runs."""
    out = record["output"]
    rows = out["scaling"]
    policies = [p for p in SCALING_POLICIES if p in next(
        (r["policies"] for r in rows if "policies" in r), {})]
    steps = out["config"]["workload"]["steps"]
    table = ["| devices | " + " | ".join(f"`{p}`" if p != "ceiling" else p for p in policies)
             + " |", "|---|" + "---|" * len(policies), *_scaling_rows(rows, policies)]
    first = next((r for r in rows if "policies" in r), None)
    words = ""
    if first:
        a, f = first["policies"]["adaptive"]["mfu"], first["policies"]["full"]["mfu"]
        words = (f"\n\nAt {first['devices']:,} devices, the fewest this layout takes, adaptive "
                 f"runs at {_pct(a)}, {_than(a, f)} full recompute's {_pct(f)}.")
    per_row = re.search(r"--scaling-steps (\d+)", record["command"])
    return "\n".join(table) + words + "\n\n" + _sim_run_note(
        record, f"`{record['command'].removeprefix('.venv/bin/spikeguard ')}`, MFU, "
                f"{int(per_row.group(1)) if per_row else steps:,} steps a row")


def sim_188b(record: dict) -> str:
    out = record["output"]
    rows = out["scaling"]
    table = ["| devices | ceiling | `none` | `experts` | `offload` | `full` | safe-static | "
             "`adaptive` |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            table.append(f"| {row['devices']:,} | {row['error']} | | | | | | |")
            continue
        p = row["policies"]
        safe = p.get("safe-static")
        label = ""
        if safe:
            label = next((f" (`{k}`)" for k in ("none", "offload", "experts", "full")
                          if k in p and p[k]["mfu"] == safe["mfu"] and not p[k]["crashes"]), "")
        table.append(f"| {row['devices']:,} | " + " | ".join(
            _pct(p[k]["mfu"]) + (f" ({p[k]['crashes']} crashes)" if p[k]["crashes"] else "")
            for k in ("ceiling", "none", "experts", "offload", "full"))
            + f" | {_pct(safe['mfu']) + label if safe else '-'} | "
            f"{_pct(p['adaptive']['mfu'])}"
            + (f" ({p['adaptive']['crashes']} crashes)" if p['adaptive']['crashes'] else "")
            + " |")
    ok = [r for r in rows if "policies" in r]
    facts = []
    if ok:
        at_ceiling = [r["devices"] for r in ok if r["policies"]["adaptive"]["mfu"]
                      >= r["policies"]["ceiling"]["mfu"] - 0.0005]
        crashes = sum(r["policies"]["adaptive"]["crashes"] for r in ok)
        facts.append(f"adaptive crashes {crashes} times over the rows" + (
            f" and runs at the ceiling's MFU (to 0.1 point) at {', '.join(f'{d:,}' for d in at_ceiling)} devices"
            if at_ceiling else ""))
        r0 = ok[0]["policies"]
        best_static = max((k for k in ("none", "experts", "offload", "full")),
                          key=lambda k: r0[k]["mfu"])
        facts.append(f"at {ok[0]['devices']:,} devices the fastest static policy is "
                     f"`{best_static}` ({_pct(r0[best_static]['mfu'])}) and adaptive is "
                     f"{_pct(r0['adaptive']['mfu'])}")
    return "\n".join(table) + "\n\nIn this run " + "; ".join(facts) + ".\n\n" + \
        _sim_run_note(record, "`simulate --preset 188b --efficiency 0.609 --scaling --steps 300 "
                              "--scaling-steps 300`, MFU")


def sim_presets(record: dict) -> str:
    """The three presets at 12,288 devices, 1,000 steps, the same efficiency; adaptive's
    step re-runs and forward safety-net re-runs, and its whole-layer recomputes."""
    runs = record["output"]
    table = ["| preset | ceiling | `none` (crashes) | `experts` | `offload` | `full` | "
             "safe-static | `adaptive` (step re-runs) |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for name in PRESETS:
        p = runs[name]["policies"]
        safe = p.get("safe-static", {})
        a = p["adaptive"]
        d = a.get("decisions", {})
        table.append(
            f"| `{name}` | {_pct(p['ceiling']['mfu'])} | {_pct(p['none']['mfu'])} "
            f"({p['none']['crashes']}) | {_pct(p['experts']['mfu'])} | "
            f"{_pct(p['offload']['mfu'])} | {_pct(p['full']['mfu'])} | "
            f"{_pct(safe['mfu']) + (' (`' + safe['setting'] + '`)' if safe.get('setting') else '') if safe else '-'} | "
            f"{_pct(a['mfu'])} ({d.get('step_rerun', 0):,}) |")
        best = max(("none", "experts", "offload", "full"),
                   key=lambda k: p[k]["mfu"] if not p[k]["crashes"] else -1)
        notes.append(
            f"`{name}`: adaptive {_than(a['mfu'], p[best]['mfu'])} the best surviving static "
            f"policy (`{best}`), {(p['ceiling']['mfu'] - a['mfu']) * 100:.1f} points under the "
            f"ceiling; {d.get('step_rerun', 0):,} step re-runs, {d.get('safety_net', 0):,} "
            f"micro-batches through the forward's safety net, {d.get('full_layer', 0):,} layers "
            f"recomputed whole at their entry, {_gb(d.get('evicted_bytes', 0))} evicted over the "
            f"run")
    steps = runs[PRESETS[0]]["config"]["workload"]["steps"]
    return "\n".join(table) + "\n\n" + "\n".join(f"- {n}." for n in notes) + \
        "\n\n(counts over all steps, stages and the ranks of one expert-parallel group) " + \
        _sim_run_note(record, f"`simulate --preset P --efficiency 0.609`, 12,288 devices, "
                              f"{steps:,} steps")


def sim_facts(record: dict) -> str:
    """What the 1,000-step `1t` run shows about `none` and adaptive, in words."""
    out = record["output"]
    p = out["policies"]
    n, a = p["none"], p["adaptive"]
    d = a.get("decisions", {})
    steps = out["config"]["workload"]["steps"]
    best = max(("none", "experts", "offload", "full"),
               key=lambda k: p[k]["mfu"] if not p[k]["crashes"] else -1)
    return "\n".join([
        f"* **`none`** crashes {n['crashes']} times in {steps:,} steps, of which "
        f"{out['spike_steps']} are spike steps" + (
            ": it crashes on calm steps too, the backward's working set (activation "
            "gradients, the head's logits gradient) landing on top of the pipeline's resident "
            "micro-batches." if n["crashes"] > out["spike_steps"] else "."),
        f"* **Adaptive** runs at {_pct(a['mfu'])} against the ceiling's "
        f"{_pct(p['ceiling']['mfu'])}, {_than(a['mfu'], p[best]['mfu'])} the best static "
        f"policy that survives (`{best}`, {_pct(p[best]['mfu'])}), with {a['crashes']} crashes "
        f"and {d.get('step_rerun', 0):,} step re-runs; it recomputes "
        f"{d.get('full_layer', 0):,} layers whole at their entry, sends "
        f"{d.get('safety_net', 0):,} micro-batches through the forward's safety net and evicts "
        f"{_gb(d.get('evicted_bytes', 0))} to host (over all steps, stages and the "
        f"ranks of one expert-parallel group)."]) + "\n\n" + _sim_run_note(
        record, "the run of the table above")


def sim_speed(record: dict) -> str:
    """sim.bench's output: its table (`--before`) as a table, other lines as printed."""
    lines = _lines(record["stdout"])
    table = [line for line in lines if line.startswith("|")]
    body = "\n".join(table) if table else _indented(lines)
    return body + "\n\n" + _example(
        record, "median of 3 runs each, interleaved, each run a fresh process; the times "
        "follow the machine's load, the CPU seconds less so")


def _lists(text: str) -> list:
    return [ast.literal_eval(m) for m in re.findall(r"\[[\[\]\d, ]*\]", text)]


def sim_validate(record: dict) -> str:
    """sim.validate's three comparisons as tables: one process (per step), PP=2 x EP=2
    (per stage and step, worst rank), and the throughput ratios."""
    lines = _lines(record["stdout"])
    out = []
    head = next(line for line in lines if line.startswith("the device's peak bytes"))
    budget = int(re.search(r"budget (\d+)", head).group(1))
    out += [f"Single process, budget {budget:,} B:", "",
            "| policy | the device's peaks | simulated peaks | worst error | runtime crashed / "
            "sim crashes |", "|---|---|---|---|---|"]
    for line in lines:
        m = re.match(r"\s+(\S+)\s+measured (\[.*?\]) predicted (\[.*?\]) worst error (\S+) \| "
                     r"runtime crashed (\w+), sim crashes (\d+)", line)
        if m:
            meas, pred = ast.literal_eval(m.group(2)), ast.literal_eval(m.group(3))
            out.append(f"| `{m.group(1)}` | {' / '.join(f'{v:,}' for v in meas)} | "
                       f"{' / '.join(f'{v:,}' for v in pred)} | {m.group(4)} | "
                       f"{m.group(5)} / {m.group(6)} |")
    plans = [line.strip() for line in lines if line.strip().startswith(("plans per step", "sim "))]
    if plans:
        out += ["", "Adaptive's " + "; ".join(re.sub(r"\s+", " ", p) for p in plans) + "."]
    ratios = [line.strip() for line in lines if re.match(r"\s+(full|adaptive)_over_ceiling", line)]
    out += ["", "Throughput ratios (" + re.search(r"measured as the device: (.*)\):",
                                                  next(l for l in lines if l.startswith(
                                                      "throughput ratios"))).group(1) + "):", "",
            "| ratio | measured | simulated | error |", "|---|---|---|---|"]
    for r in ratios:
        m = re.match(r"(\S+)\s+measured (\S+) simulated (\S+) \((\S+)\)", r)
        out.append(f"| {m.group(1).replace('_over_', ' / ')} | {m.group(2)} | {m.group(3)} | "
                   f"{m.group(4)} |")
    diag = next((l.strip() for l in lines if l.strip().startswith("diagnostics")), "")
    if diag:
        out += ["", diag.replace("diagnostics (not simulated): ", "Not simulated, measured in "
                                 "the same rounds: ") + "."]
    pp = [l for l in lines if re.match(r"\s+\S+\s+budget \S+: measured", l)]
    if pp:
        out += ["", "PP=2 x EP=2, 4 processes, worst rank of each stage:", "",
                "| policy (budget) | stage | the device's peaks, step by step | simulated | "
                "worst error of the policy |", "|---|---|---|---|---|"]
        for line in pp:
            m = re.match(r"\s+(\S+)\s+budget (\S+): measured (.*) predicted (.*) worst error "
                         r"(\S+)", line)
            meas, pred = ast.literal_eval(m.group(3)), ast.literal_eval(m.group(4))
            budget = m.group(2)
            budget = f"{int(budget):,} B" if budget.isdigit() else budget
            for stage in range(len(meas[0])):   # measured[step][stage]
                first = stage == 0
                out.append(f"| {f'`{m.group(1)}` ({budget})' if first else ''} | {stage} | "
                           f"{' / '.join(f'{step[stage]:,}' for step in meas)} | "
                           f"{' / '.join(f'{step[stage]:,}' for step in pred)} | "
                           f"{m.group(5) if first else ''} |")
    return "\n".join(out) + "\n\n" + _example(
        record, "the peaks move by gloo's held rows under EP and the ratios with the load")


# ---- the Hugging Face benches (docs/hf.md) -----------------------------------------------

def _rich_tables(text: str) -> list[dict]:
    """The rich tables runtime_ratios.print_table prints: each one's title (rich may wrap
    it over lines), its rows (a dict per row, by the header's cells) and the summary lines
    printed after it."""
    tables, title, header = [], [], None
    for line in text.splitlines():
        if "┃" in line:
            header = [c.strip() for c in line.strip().strip("┃").split("┃")]
        elif "│" in line and header:
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            rows = tables[-1]["rows"]
            if rows and not cells[0]:   # a cell rich wrapped onto the next line
                rows[-1] = {k: (v + " " + c).strip() for (k, v), c in zip(rows[-1].items(), cells)}
            else:
                rows.append(dict(zip(header, cells)))
        elif line.startswith("┏"):
            tables.append({"title": " ".join(title), "rows": [], "after": []})
            title = []
        elif line.startswith(("adaptive/ceiling", "spread", "worst rank")) and tables:
            tables[-1]["after"].append(line.strip())
        elif line.strip() and not line.startswith(("┡", "└")):
            title.append(line.strip())
    return tables


def _spreads(table: dict) -> dict:
    """{policy: (low, high)} from the `spread (25-75th pct ...)` line under a table, or
    from its `quartiles` column (runtime_ratios.print_table prints it since)."""
    line = next((a for a in table.get("after", []) if a.startswith("spread")), "")
    if not line:
        return {r["policy"]: tuple(float(x) for x in r["quartiles"].split("-"))
                for r in table["rows"] if "-" in r.get("quartiles", "")}
    return {k: (float(lo), float(hi)) for k, lo, hi in
            re.findall(r"(\w[\w-]*) (\d\.\d+)-(\d\.\d+)", line.split(":", 1)[-1])}


def _ratio_cell(row: dict, spread: dict) -> str:
    lo_hi = spread.get(row["policy"])
    return row["vs ceiling"] + (f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi else "")


def _order(rows: dict, spread: dict, a: str, b: str) -> str:
    """'`a` above `b`', '`a` below `b`', or 'within the spreads', from the medians and the
    25th-75th percentiles of the per-round ratios."""
    x, y = float(rows[a]["vs ceiling"]), float(rows[b]["vs ceiling"])
    return f"`{a}` is {_than(x, y, spread.get(a), spread.get(b))} `{b}`"


def hf_bench(record: dict) -> str:
    out = ["| model | adaptive / ceiling | full / ceiling | experts / ceiling | `none` (no "
           "limit) / ceiling | gap closed | adaptive's peak / budget | save / rec / off (last "
           "step) | evicted (last step) | overruns / re-runs |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    orders = []
    for model, table in zip(HF_MODELS, _rich_tables(record["stdout"])):
        rows = {r["policy"]: r for r in table["rows"]}
        spread = _spreads(table)
        a = rows["adaptive"]
        # the title is what came since the last table: its notes first, then this title
        budget = re.findall(r"budget ([\d.,]+ [KMG]?i?B) =", table["title"])[-1]
        gap = re.search(r"gap closed (\S+)", " ".join(table.get("after", [])))
        out.append(f"| {model} | {_ratio_cell(a, spread)} | {_ratio_cell(rows['full'], spread)} | "
                   f"{_ratio_cell(rows['experts'], spread)} | {_ratio_cell(rows['none'], spread)} | "
                   f"{gap.group(1) if gap else '-'} | {a['peak']} / {budget} | "
                   f"{a['save / recompute / offload']} | {a['evicted']} | "
                   f"{a['overruns']} / {a['reruns']} |")
        orders.append(f"{model}: {_order(rows, spread, 'adaptive', 'full')}, "
                      f"{_order(rows, spread, 'adaptive', 'experts')}")
    return "\n".join(out) + "\n\nIn brackets the 25th-75th percentile of the per-round ratio. " \
        "In this run " + "; ".join(orders) + " (\"within the spread\": the percentiles " \
        "overlap). " + _example(record, "the decisions and evictions follow the cost model's "
                                "timings")


def hf_bench_ep(record: dict) -> str:
    table = _rich_tables(record["stdout"])[0]
    rows = {r["policy"]: r for r in table["rows"]}
    spread = _spreads(table)
    worst = next((a for a in table.get("after", []) if a.startswith("worst rank")), "")
    world = dict(re.findall(r"(\w[\w-]*) (\d[\d.]* MiB)", worst.split(":", 1)[-1]))
    budget = re.search(r"budget (.*?) =", table["title"]).group(1)
    out = [f"| policy | / ceiling (median) | 25th-75th pct of the per-round ratio | worst "
           f"rank's peak (budget {budget}) | save / rec / off (rank 0, last step) | evicted "
           f"(rank 0) | overruns / re-runs |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lo_hi = spread.get(name)
        out.append(f"| {name + (' (bookkeeping only, no limit)' if name == 'none' else '')} | "
                   f"{r['vs ceiling']} | {f'{lo_hi[0]:.2f}-{lo_hi[1]:.2f}' if lo_hi else '-'} | "
                   f"{world.get(name, r['peak'])} | {r['save / recompute / offload']} | "
                   f"{r['evicted']} | {r['overruns']} / {r['reruns']} |")
    orders = [_order(rows, spread, "adaptive", b) for b in ("full", "experts") if b in rows]
    return "\n".join(out) + "\n\nIn this run " + ", ".join(orders) + \
        " (\"within the spread\": the percentiles overlap). " + _example(
            record, "rank 0's times; the decisions follow each rank's cost model")


def trainer_bench(record: dict) -> str:
    lines = _lines(record["stdout"])   # the Trainer's own dicts come first
    head = next(i for i, line in enumerate(lines) if line.startswith("transformers Trainer"))
    lines = lines[head:]
    budget = int(re.search(r"= (\d+) B", lines[0]).group(1))
    out = [f"| policy / ceiling | median | 25th-75th pct | CPU median (25th-75th) | largest "
           f"device peak (worst rank) | under the budget ({budget:,} B) | re-runs |",
           "|---|---|---|---|---|---|---|"]
    found = {}
    for line in lines[1:]:
        m = re.match(r"\s*(\S+)\s+/ ceiling\s+median (\S+)\s+\(25-75%: (\S+)-(\S+)\)\s+"
                     r"(?:cpu (\S+) \((\S+)-(\S+)\)\s+)?peak (\d+) B <= budget: (\w+)\s+"
                     r"re-runs (\d+)", line)
        if m:
            name, med, lo, hi, cpu, cpu_lo, cpu_hi, peak, under, reruns = m.groups()
            found[name] = (float(med), (float(lo), float(hi)))
            cpu_cell = f"{cpu} ({cpu_lo}-{cpu_hi})" if cpu else "-"
            out.append(f"| {name} | {med} | {lo}-{hi} | {cpu_cell} | {int(peak):,} B | "
                       f"{'yes' if under == 'True' else 'no'} | {reruns} |")
    words = ""
    if {"adaptive", "full"} <= set(found):
        (a, sa), (f, sf) = found["adaptive"], found["full"]
        words = (f"\n\nIn this run adaptive is {_than(a, f, sa, sf)} full, and "
                 f"{'above' if a > 1 else 'below' if a < 1 else 'level with'} the unguarded "
                 f"Trainer by its median.")
    return "\n".join(out) + words + "\n\n" + _example(record, "on a loaded machine the "
                                                        "rounds spread widely")


def calm_overhead(record: dict) -> str:
    return _indented(_lines(record["stdout"])) + "\n\n" + _example(
        record, "ms: the median step, in brackets its fastest and slowest round; plain/this: "
        "the median of the per-round ratios, [95%] that median's interval (order statistics), "
        "then the rounds' range and how many would resolve +-0.01; the medians move with the "
        "load")


def flag_point_cost(record: dict) -> str:
    return _indented(_lines(record["stdout"])) + "\n\n" + _example(
        record, "ms: per collective, the median over rounds of (the blocks with one each - "
        "the blocks alone) / blocks, [95%] that median's interval (order statistics); the "
        "worst rank is the one whose median is highest; the figures move with the load")


def snippet(record: dict) -> str:
    """What the page's example printed, as printed."""
    return _indented(_lines(record["stdout"])) + "\n\n" + _example(
        record, "one process, seeded: which experts call moves follows the cost model's "
        "timings, and a step the net re-runs shows `recompute`")


def one_line(record: dict) -> str:
    """A run that dies: its lines on stderr (the `spikeguard:` ones), as printed."""
    return _indented([l for l in _lines(record["stderr"]) if l.startswith("spikeguard")]) + \
        "\n\n" + _example(record, "exit " + str(record["exit"]))


DIES_MASKS = TIMINGS + (r"\b(?:forward|backward)\b", r"micro-batch \d+", r"layer \d+")


def _dies(record: dict) -> str:
    return "\n".join(l for l in _lines(record["stderr"]) if l.startswith("spikeguard"))


MORE = [
    # Re-run by the suite: the one line must stay; phase and sizes move with gloo's rows.
    Block("pp-none", PP.replace("--policy adaptive", "--policy none"), one_line, exits=3,
          stable=_dies, masks=DIES_MASKS, bytes_tol=0.1, long=True),
    Block("pp-full-1.2", PP.replace("--budget 1.5MiB --policy adaptive",
                                    "--budget 1.2MiB --policy full"), one_line, exits=3,
          stable=_dies, masks=DIES_MASKS, bytes_tol=0.1, long=True),
    Block("hf-none", HF + " --policy none", one_line, exits=3, stable=_dies,
          masks=DIES_MASKS, bytes_tol=0.1, long=True),
    Block("hf-ep-none", HF_EP + " --policy none", one_line, exits=3, stable=_dies,
          masks=DIES_MASKS, bytes_tol=0.1, long=True),
    Block("hf-snippet", ".venv/bin/python scripts/page_snippet.py docs/hf.md 0", snippet,
          links=("scripts", "docs")),
    Block("trainer-snippet", ".venv/bin/python scripts/page_snippet.py docs/hf.md 1", snippet,
          links=("scripts", "docs")),
    Block("sim-presets", SIM_PRESETS, sim_presets, output="presets.json", timeout_s=1200),
    Block("sim-scaling", SIM_SCALING, sim_scaling, output="sim.json", timeout_s=1800),
    Block("sim-188b", SIM_188B, sim_188b, output="sim.json", timeout_s=1800),
    Block("sim-1t-facts", SIM_SCALING, sim_facts, output="sim.json", record="sim-scaling"),
    Block("sim-speed", SIM_SPEED, sim_speed, timeout_s=3600),
    Block("sim-validate", VALIDATE, sim_validate, timeout_s=1800),
    Block("hf-bench", HF_BENCH, hf_bench, timeout_s=2400),
    Block("hf-bench-ep", HF_BENCH_EP, hf_bench_ep, timeout_s=1800),
    Block("trainer-bench", TRAINER, trainer_bench, timeout_s=1800),
    Block("trainer-bench-ep", TRAINER_EP, trainer_bench, timeout_s=1800),
    Block("calm-overhead", CALM, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("calm-overhead-ep", CALM_EP, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("calm-overhead-hf", CALM_HF, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("calm-overhead-hf-ep", CALM_HF_EP, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("calm-overhead-pp", CALM_PP, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("flag-point-cost", FLAG_COST, flag_point_cost, timeout_s=600, links=("scripts",)),
    Block("calm-overhead-titan", CALM_TITAN, calm_overhead, timeout_s=1200, links=("scripts",)),
    Block("calm-overhead-titan-ep", CALM_TITAN_EP, calm_overhead, timeout_s=1200,
          links=("scripts",)),
    Block("calm-overhead-titan-fsdp", CALM_TITAN_FSDP, calm_overhead, timeout_s=1200,
          links=("scripts",)),
    Block("bench-prose", "make bench", bench_prose, source="docs/bench.json"),
    Block("bench-pp-prose", "make bench-pp", bench_pp_prose, source="docs/bench_pp.json"),
]
