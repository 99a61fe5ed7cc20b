"""Plots from training logs and `spikeguard report`: what each figure holds, valid PNGs,
degraded logs, one-line errors.

    .venv/bin/python -m pytest tests/bench/test_bench_plots.py -q
"""

from __future__ import annotations

import struct
from statistics import median

import numpy as np
import pytest

from spikeguard import cli
from spikeguard.bench import plots
from spikeguard.bench.plots import NothingToPlot

LAYERS, RANKS, BUDGET = 2, 2, 3 * 1024 ** 2


def _records(steps=8, *, guard=True, ep=True, skew=True, crash_at=None, skip=(),
             rate=1000.0, recompute_at=(4,)):
    """Synthetic step records shaped like spikeguard train --log's (rank 0's file)."""
    out = []
    for step in range(1, steps + 1):
        spike = skew and step % 4 == 0
        r = {"step": step, "loss": 5.0 - 0.1 * step, "tokens": 256,
             "step_time_s": 256 / (rate + step), "tokens_per_s": rate + step,
             "imbalance_per_layer": [1.5 + 0.1 * layer for layer in range(LAYERS)]}
        if guard:
            peak = int(BUDGET * (0.95 if spike else 0.8))
            dec = {"save": 10, "recompute": 3 if step in recompute_at else 0, "offload": 0}
            r.update(policy="adaptive", peak_bytes=peak, budget_bytes=BUDGET,
                     static_bytes=BUDGET // 4, decisions=dec, safety_net_reruns=0)
        if ep:
            hot = 1.8 if spike else 1.1
            r["rank_imbalance"] = [[hot + 0.01 * layer, 2 - hot - 0.01 * layer]
                                   for layer in range(LAYERS)]
            if guard:
                r.update(rank_peak_bytes=[r["peak_bytes"], r["peak_bytes"] // 2],
                         max_peak_bytes=r["peak_bytes"], peak_rank=0,
                         rank_decisions=[r["decisions"], {"save": 10, "recompute": 0,
                                                          "offload": 0}])
        if skew:
            r.update(skew_spike=spike, skew_hot_rank=0, skew_target=1.8 if spike else 1.1)
        if step == crash_at:
            r["crashed"] = True
            del r["step_time_s"], r["tokens_per_s"]
        if step in skip:
            r["skipped"] = True
        out.append(r)
    return out


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def _lines(ax, gid):
    """The lines plots.py tagged with `gid` (peak, budget, others-budget, crash)."""
    return [line for line in ax.get_lines() if line.get_gid() == gid]


# ---- the figures' contents ---------------------------------------------------------------

def test_memory_timeline_one_panel_per_policy_with_budget_crash_and_decisions():
    runs = {"ceiling": _records(), "none": _records(crash_at=4, skip=(5,)),
            "adaptive": _records(recompute_at=(4, 8))}
    fig = plots.memory_timeline(runs)
    assert len(fig.axes) == 3
    ceiling_ax, none_ax, adaptive_ax = fig.axes
    for ax in fig.axes:
        (peak_line,) = _lines(ax, "peak")
        assert [ln.get_ydata()[0] for ln in _lines(ax, "budget")] == [pytest.approx(3.0)]  # MiB
        assert np.nanmax(peak_line.get_ydata()) == pytest.approx(0.95 * 3)
    # The crashed step is an X, and the line breaks over it and the skipped step.
    crosses = _lines(none_ax, "crash")
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [4]
    xs = _lines(none_ax, "peak")[0].get_xdata()
    assert np.isnan(xs).sum() == 1 and 4 not in xs and 5 not in xs
    assert "1 crash" in none_ax.get_title(loc="left")
    assert "1 step lost" in none_ax.get_title(loc="left")
    # Recompute markers where the hot rank recomputed: one per such step.
    assert sum(len(c.get_offsets()) for c in adaptive_ax.collections) == 2
    assert sum(len(c.get_offsets()) for c in ceiling_ax.collections) == 1
    # Spike steps shaded (steps 4 and 8): two spans per panel.
    assert len(ceiling_ax.patches) == 2


def test_a_crash_marker_without_skew_fields_takes_the_spike_from_the_other_runs():
    bench_marker = {"step": 4, "crashed": True, "skipped": True, "tokens": 0}  # runner.py's
    none = [r for r in _records() if r["step"] != 4] + [bench_marker]
    runs = {"ceiling": _records(), "none": none, "short": _records(steps=3)}
    assert plots.spike_steps(none, runs) == [4, 8]
    assert plots.spike_steps(none) == [8]
    assert plots.spike_steps(runs["short"], runs) == []   # a step it never reached: not its
    none_ax = plots.memory_timeline(runs).axes[1]
    assert len(none_ax.patches) == 2
    assert [ln.get_ydata()[0] for ln in _lines(none_ax, "crash")] == [pytest.approx(3.0)]


def test_memory_timeline_degrades_and_refuses_when_nothing_to_draw():
    fig = plots.memory_timeline({"guarded": _records(ep=False, skew=False),
                                 "plain": _records(guard=False)})
    assert len(fig.axes) == 2
    assert _lines(fig.axes[0], "peak")          # single-process peak_bytes is drawn
    assert sum(len(c.get_offsets()) for c in fig.axes[0].collections) == 1  # its decisions
    assert not _lines(fig.axes[1], "peak")
    assert _lines(fig.axes[1], "others-budget")
    assert "no peak_bytes recorded" in fig.axes[1].texts[0].get_text()
    # An unguarded expert-parallel rank logs max_peak_bytes 0: not a measured peak.
    unguarded_ep = [dict(r, rank_peak_bytes=[0, 0], max_peak_bytes=0, peak_rank=0)
                    for r in _records(guard=False)]
    with pytest.raises(NothingToPlot, match="peak_bytes"):
        plots.memory_timeline({"plain": _records(guard=False), "ep": unguarded_ep})


def test_throughput_bars_are_medians_of_completed_steps_over_the_ceiling():
    runs = {"ceiling": _records(rate=2000.0), "full": _records(rate=1000.0),
            "none": _records(rate=1500.0, crash_at=3, skip=(4,))}
    medians = [median(2000.0 + s for s in range(1, 9)), median(1000.0 + s for s in range(1, 9)),
               median(1500.0 + s for s in range(1, 9) if s not in (3, 4))]
    fig = plots.throughput(runs, effective={"ceiling": 1800.0, "none": 450.0})
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert heights[:3] == pytest.approx([m / medians[0] for m in medians])
    assert heights[3:] == pytest.approx([1.0, np.nan, 0.25], nan_ok=True)  # over ceiling's
    texts = [t.get_text() for t in ax.texts]
    assert f"{medians[1] / medians[0]:.2f}x" in texts and "0.25x" in texts
    # The bench's own ratios, when given, are the bars (picture and table agree).
    ax = plots.throughput(runs, relative={"ceiling": 1.0, "full": 0.123, "none": 0.7}).axes[0]
    assert [p.get_height() for p in ax.patches] == pytest.approx([1.0, 0.123, 0.7])
    # Without a ceiling: tokens/s.
    ax = plots.throughput({"full": runs["full"], "none": runs["none"]}).axes[0]
    assert [p.get_height() for p in ax.patches] == pytest.approx(medians[1:])
    assert ax.get_ylabel() == "tokens / s"
    with pytest.raises(NothingToPlot):
        plots.throughput({"a": [{"step": 1}]})


def test_imbalance_heatmap_rows_are_layer_by_rank_and_columns_steps():
    ep = _records(steps=6, crash_at=3)
    fig = plots.imbalance_heatmap({"ep": ep, "single": _records(steps=4, ep=False)})
    ep_ax, single_ax = [ax for ax in fig.axes if ax.get_images()]
    assert len(fig.axes) == 4                      # two panels, two colour bars
    matrix = ep_ax.get_images()[0].get_array()
    assert matrix.shape == (LAYERS * RANKS, 6)
    assert matrix[2, 3] == pytest.approx(ep[3]["rank_imbalance"][1][0])   # L1 r0, step 4
    assert matrix.mask[:, 2].all()                 # the crashed step has no completed record
    assert [t.get_text() for t in ep_ax.get_yticklabels()] == ["L0 r0", "L0 r1", "L1 r0", "L1 r1"]
    # Without expert parallelism: one row per layer, the experts' imbalance.
    single = single_ax.get_images()[0].get_array()
    assert single.shape == (LAYERS, 4) and single[1, 0] == pytest.approx(1.6)
    with pytest.raises(NothingToPlot):
        plots.imbalance_heatmap({"a": [{"step": 1, "rank_imbalance": "garbage"}]})
    # One colour scale for every panel (a crashed spike must not rescale one run's colours).
    norms = [ax.get_images()[0].norm for ax in (ep_ax, single_ax)]
    assert norms[0].vmin == norms[1].vmin and norms[0].vmax == norms[1].vmax
    far = _records(steps=2, ep=False)
    far[1]["step"] = 10 ** 9
    with pytest.raises(NothingToPlot, match="span"):
        plots.imbalance_heatmap({"far": far})


def test_draw_plots_writes_valid_pngs(tmp_path):
    runs = {"ceiling": _records(), "adaptive": _records(recompute_at=(4, 8))}
    written, notes = plots.draw_plots(runs, tmp_path, effective={"adaptive": 900.0})
    assert notes == []
    assert sorted(p.name for p in written) == sorted(plots.PLOT_FILES.values())
    for path in written:
        (width, height), size = _png_size(path)
        assert width >= 400 and height >= 300 and size > 10_000


# ---- spikeguard report on a real log -----------------------------------------------------

@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """A tiny single-process guarded run's log, made in-process through the CLI."""
    log = tmp_path_factory.mktemp("real") / "tiny.jsonl"
    assert cli.main(["train", "--preset", "tiny", "--steps", "3", "--batch-size", "2",
                     "--budget", "4MiB", "--policy", "adaptive", "--threads", "1",
                     "--eval-batches", "1", "--log", str(log)]) == 0
    return log


def test_report_draws_from_a_real_log_and_leaves_it_alone(real_log, tmp_path, capsys):
    before = real_log.read_bytes()
    out = tmp_path / "plots" / "nested"
    assert cli.main(["report", str(real_log), "--plots", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(out / n) for n in ("memory_timeline.png",
                                                             "imbalance.png"))
    for path in printed:
        (width, height), size = _png_size(out / path.rsplit("/", 1)[1])
        assert width >= 400 and size > 10_000
    assert real_log.read_bytes() == before
    # Two logs (one renamed copy): throughput too, and a second run over the same folder,
    # which needs --overwrite (refused without it, the PNGs untouched).
    other = tmp_path / "other.jsonl"
    other.write_bytes(before)
    png = (out / "memory_timeline.png").read_bytes()
    assert cli.main(["report", str(real_log), str(other), "--plots", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "exists; pass --overwrite" in err[0], err
    assert (out / "memory_timeline.png").read_bytes() == png
    assert cli.main(["report", str(real_log), str(other), "--plots", str(out),
                     "--overwrite"]) == 0
    assert (out / "throughput.png").exists()
    assert len(capsys.readouterr().out.split()) == 3


def _bad_cases(tmp_path, real_log):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    good = real_log.read_text().splitlines()
    (tmp_path / "broken.jsonl").write_text("\n".join(good[:2] + ['{"step": 3, "loss": ']))
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "nostep.jsonl").write_text('{"loss": 1.0}\n')
    (tmp_path / "trace.jsonl").write_text('{"format": "spikeguard-trace", "version": 1}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "useless.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "holds_text").mkdir()
    (tmp_path / "holds_text" / "imbalance.png").write_text("my notes")
    (tmp_path / "holds_log").mkdir()
    (tmp_path / "holds_log" / "memory_timeline.png").write_text(real_log.read_text())
    log, t = str(real_log), str(tmp_path)
    return {
        "missing log": ([f"{t}/nope.jsonl"], "log not found"),
        "log is a folder": ([t], "directory"),
        "empty log": ([f"{t}/empty.jsonl"], "empty"),
        "blank log": ([f"{t}/blank.jsonl"], "empty"),
        "malformed line": ([log, f"{t}/broken.jsonl"], "line 3"),
        "not an object": ([f"{t}/list.jsonl"], "line 1: expected a JSON object"),
        "no step": ([f"{t}/nostep.jsonl"], "integer 'step'"),
        "a trace": ([f"{t}/trace.jsonl"], "routing trace"),
        "binary": ([f"{t}/binary.jsonl"], "UTF-8"),
        "given twice": ([log, log], "given twice"),
        "nothing drawable": ([f"{t}/useless.jsonl"], "no plot could be drawn"),
        "plots is a file": ([log, "--plots", f"{t}/a_file"], "is a file"),
        "plots under a file": ([log, "--plots", f"{t}/a_file/sub"], "under a file"),
        "would overwrite text": ([log, "--plots", f"{t}/holds_text"], "not a PNG"),
        "would overwrite a log": ([f"{t}/holds_log/memory_timeline.png", "--plots",
                                   f"{t}/holds_log"], "overwrite the log"),
        "unknown flag": ([log, "--bogus"], "unrecognized"),
        "no --plots": ([log], "required: --plots"),
    }


def test_report_bad_input_is_exit_2_one_line_and_writes_nothing(real_log, tmp_path, capsys):
    cases = _bad_cases(tmp_path, real_log)
    protected = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for case, (args, message) in cases.items():
        if "--plots" not in args and case != "no --plots":
            args = args + ["--plots", str(tmp_path / "out")]
        assert cli.main(["report", *args]) == 2, case
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("spikeguard: error:"), (case, err)
        assert message in err[0], (case, err)
    assert not (tmp_path / "out").exists()   # nothing written before every input is checked
    assert {p: p.read_bytes() for p in protected} == protected
