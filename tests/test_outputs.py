"""Outputs people look at: the bench plots, the eval report's rows, traces, and progress within a configuration."""

import itertools
import math

import pytest

from dllm.eval.study import bench_report, cost_model

plt = cost_model.pyplot()
needs_matplotlib = pytest.mark.skipif(plt is None, reason="matplotlib is not installed")


def _run(name: str, sampler: str, speed: float, accuracy: float, accept=()) -> dict:
    return {"name": name, "sampler": sampler, "tokens_per_s": speed, "tokens_per_s_min": speed * 0.9,
            "tokens_per_s_max": speed * 1.1, "accuracy": accuracy, "tokens_per_row_call": 1.0,
            "acceptance_per_position": list(accept)}


# Two coinciding points, two close ones, and a front of three (slow and accurate to fast and rough).
RUNS = [_run("a", "ar", 21.0, 0.25), _run("b", "fef", 21.0, 0.25), _run("c", "fef", 21.5, 0.25),
        _run("d", "llada", 45.0, 0.75), _run("e", "fef", 160.0, 0.5), _run("f", "ar_spec", 300.0, 0.5)]


@needs_matplotlib
def test_pareto_draws_its_front_as_a_staircase_through_its_points():
    fig = bench_report.pareto_figure(plt, RUNS)
    ax = fig.axes[0]
    front = next(line for line in ax.lines if line.get_label() == "Pareto front")
    assert list(zip(front.get_xdata(), front.get_ydata())) == [(45.0, 0.75), (300.0, 0.5)]
    assert front.get_drawstyle() == "steps-pre"  # no corner above the points: nothing reaches (300, 0.75)
    plt.close(fig)


@needs_matplotlib
def test_pareto_labels_stay_apart_and_ticks_are_plain_numbers():
    fig = bench_report.pareto_figure(plt, RUNS)
    ax = fig.axes[0]
    fig.canvas.draw()
    labels = [t for t in ax.texts if t.get_text().isdigit()]
    assert sorted(t.get_text() for t in labels) == ["1", "2", "3", "4", "5", "6"]
    centres = [t.get_window_extent().get_points().mean(axis=0) * 72 / fig.dpi for t in labels]
    for p, q in itertools.combinations(centres, 2):
        assert math.dist(p, q) >= bench_report.LABEL_SPACING - 1.0  # anchors apart, up to glyph widths
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert len(ticks) >= 3 and all(t.replace(".", "").isdigit() for t in ticks), ticks  # no 2x10^1 mathtext
    plt.close(fig)


def _legend_lines(ax) -> dict:
    legend = ax.get_legend()
    return {text.get_text(): line for text, line in zip(legend.get_texts(), legend.get_lines(), strict=True)}


@needs_matplotlib
@pytest.mark.parametrize("runs", [RUNS, [_run("slow", "ar", 10.0, 0.5), _run("fast", "fef", 20.0, 0.75)]],
                         ids=["front of two", "front of one point"])
def test_pareto_legend_shows_only_what_is_drawn(runs):
    """A front of one point draws no line, so its legend entry shows the ring alone; runs show their marker."""
    fig = bench_report.pareto_figure(plt, runs)
    ax = fig.axes[0]
    legend = _legend_lines(ax)
    front = next(line for line in ax.lines if line.get_label() == "Pareto front")
    drawn_line = len(front.get_xdata()) > 1
    assert (legend["Pareto front"].get_linestyle() not in ("None", "none", "")) == drawn_line
    assert front.get_linestyle() == legend["Pareto front"].get_linestyle()
    assert legend["Pareto front"].get_marker() == "o"
    for i, run in enumerate(runs):
        entry = legend[f"{i + 1}. {run['name']}"]
        assert entry.get_linestyle() in ("None", "none", "") and entry.get_marker() not in ("None", "none", "")
    plt.close(fig)


def _calls_run(name: str, sampler: str, target: float, draft: float = 0.0) -> dict:
    return {"name": name, "sampler": sampler, "tokens_per_row_call": 1.0, "forward_tokens_per_token": target,
            "forward_tokens_draft_per_token": draft}


@needs_matplotlib
def test_every_bar_of_tokens_per_call_is_visible():
    """ar's bar is the smallest: an axis must start below it (a log axis autoscaled to the bars hid it)."""
    runs = [_calls_run("ar greedy", "ar", 3.5), _calls_run("ar_spec drafter-ar k4", "ar_spec", 3.5, 3.5),
            _calls_run("sequential no-cache", "sequential", 57.0), _calls_run("fef w4 no-cache", "fef", 68.125)]
    fig = bench_report.calls_figure(plt, runs)
    fig.canvas.draw()
    bars = 0
    for ax in fig.axes:
        low, high = ax.get_xlim()
        for bar in ax.patches:
            if bar.get_width() > 0:
                left, right = max(bar.get_x(), low), min(bar.get_x() + bar.get_width(), high)
                (x0, _), (x1, _) = ax.transData.transform([(left, 0), (right, 0)])
                assert x1 - x0 >= 1.0, (ax.get_xlabel(), bar.get_x(), bar.get_width(), (low, high))
                bars += 1
    assert bars == 4 + 4 + 1  # both panels' target bars and the one drafter bar
    plt.close(fig)


def test_log_ticks_are_readable_over_narrow_and_wide_ranges():
    assert bench_report._log_ticks(15, 250) == [20, 50, 100, 200]
    narrow = bench_report._log_ticks(20, 26)
    assert len(narrow) >= 3 and all(20 <= t <= 26 for t in narrow)
    assert len(bench_report._log_ticks(0.01, 1e6)) <= 8


def test_label_offsets_separate_coinciding_points():
    offsets = bench_report.label_offsets([[0.0, 0.0]] * 5 + [[100.0, 0.0]], spacing=10.0)
    placed = [(dx, dy) for dx, dy in offsets[:5]]
    assert all(math.dist(p, q) >= 10.0 for p, q in itertools.combinations(placed, 2))
    assert offsets[5] == (4.0, 4.0)  # a lone point keeps the usual place


@needs_matplotlib
def test_identical_acceptance_curves_are_distinguishable():
    curve = [1.0, 0.6, 0.3]
    runs = [_run(f"fef w4 {k}", "fef", 10.0, 0.5, curve) for k in range(12)] + [_run("ar", "ar", 10.0, 0.5)]
    fig = bench_report.acceptance_figure(plt, runs)
    lines = fig.axes[0].lines
    assert len(lines) == 12
    styles = [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in lines]
    assert len(set(styles)) == 12  # no two curves drawn alike
    xs = [tuple(line.get_xdata()) for line in lines]
    assert len(set(xs)) == 12 and all(abs(x - j) < 0.2 for row in xs for j, x in enumerate(row))
    assert all(tuple(line.get_ydata()) == tuple(curve) for line in lines)  # values are not moved
    plt.close(fig)


def test_eval_report_rows_name_their_folder(tmp_path, capsys):
    """Two runs alike in every column the table shows (seeds differ) are told apart by their folders."""
    from test_eval_report import _stats, _write_run

    from dllm.eval import report

    folders = [_write_run(tmp_path / f"gsm8k-fef-seed{seed}", "gsm8k", "fef", {}, [
        (_stats(4, 16, 2.0, 8), [{"id": "a", "correct": True, "strict": True}])]) for seed in (0, 1)]
    assert report.main([str(f) for f in folders] + ["--png", str(tmp_path / "chart.png")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "| gsm8k |" in line]
    assert [row.split(" | ")[0] for row in rows] == [f"| {f}" for f in folders]


# ------------------------------------------------------------------ traces


def test_trace_drops_the_columns_after_the_rows_stop():
    from dllm.eval.study.trace import Cell, Round, drop_after_stop

    eos, eot, mask = 1, 2, 9
    rounds = [Round("r1", [Cell(5, "fixed"), Cell(None, "masked"), Cell(None, "masked"), Cell(None, "masked")]),
              Round("r2", [Cell(5, "done"), Cell(eot, "fixed"), Cell(eos, "fixed"), Cell(eos, "fixed")])]
    kept = drop_after_stop(rounds, (eos, eot))  # a stop id other than the first ends the row too
    assert [len(r.cells) for r in kept] == [2, 2] and kept[1].cells[1].token == eot
    assert [len(r.cells) for r in drop_after_stop(rounds, (7,))] == [4, 4]  # no stop: nothing dropped
    assert mask not in [c.token for r in kept for c in r.cells]


def test_rendered_trace_ends_at_each_rows_stop(tmp_path):
    import re

    import torch

    import dllm
    from dllm.eval.study.trace import TraceRecorder, render_trace

    oracle = dllm.HMMOracle.random(num_states=4, num_tokens=8, seed=0, stickiness=3.0, sharpness=2.0)
    trace = TraceRecorder()
    out = dllm.generate(oracle, torch.tensor([[0, 1, 2, 0]] * 4), sampler="fef", max_new_tokens=16, temperature=1.0,
                        generator=torch.Generator().manual_seed(3), callback=trace, window=4, eos_token_id=[3, 5])
    answers = out.sequences[:, 4:].tolist()
    stopped = [r for r, a in enumerate(answers) if 3 in a[:-1] or 5 in a[:-1]]
    assert stopped, answers  # some row stops before the end, so columns are dropped
    for row in stopped:
        page = render_trace(trace.events, list("abcdefgh"), tmp_path / f"{row}.html", row=row,
                            mask_token_id=oracle.mask_token_id, stop_token_ids=[3, 5]).read_text()
        stop = next(j for j, t in enumerate(answers[row]) if t in (3, 5))
        assert len(re.findall(r"<th>\d+</th>", page)) == stop + 1, (row, answers[row])
        assert "<b>prompt:</b> <code>abca</code>" in page  # the prompt is not read off the shortened rounds


def test_cli_trace_says_where_it_was_written(tmp_path, capsys):
    from fixtures.hf import builders

    from dllm.cli import main

    model = builders.save_dllm(tmp_path / "model", layout="block_causal")
    path = tmp_path / "trace.html"
    assert main(["generate", "Tom has 3", "--model", str(model), "--max-new-tokens", "4", "--option", "block_length=2",
                 "--trace", str(path)]) == 0
    assert f"trace written to {path.resolve()}" in capsys.readouterr().err


# ------------------------------------------------------------------ bench progress


class Bars:
    """Stands in for progress_bar: records each bar's description, total, updates and postfixes."""

    def __init__(self):
        self.bars = []

    def __call__(self, total, desc):
        bar = {"desc": desc, "total": total, "updates": 0, "postfix": []}
        self.bars.append(bar)

        class Bar:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def update(self, n=1):
                bar["updates"] += n

            def set_postfix_str(self, text):
                bar["postfix"].append(text)

        return Bar()


def test_bench_shows_progress_batch_by_batch_within_each_configuration():
    import torch

    import dllm
    from dllm.eval.study import bench

    oracle = dllm.HMMOracle.random(num_states=3, num_tokens=6, seed=0)
    prompts = [[0, 1, 2], [1, 2], [2, 0, 1, 1], [3]]
    batches = bench.make_batches(prompts, 1, 0, "cpu")  # 4 batches
    assert len(batches) == 4 and all(isinstance(b.input_ids, torch.Tensor) for b in batches)
    runs = [bench.Prepared(bench.parse_config(f"name={n};model=m;sampler=sequential"), oracle, {}, 0.0)
            for n in ("x", "y")]
    bars = Bars()
    bench.time_study(runs, batches, bench.Settings(repeats=2, warmup=1, max_new_tokens=2), progress=lambda _: None,
                     bar=bars)
    assert [(b["desc"], b["total"], b["updates"]) for b in bars.bars] == [
        ("  recording x", 4, 4), ("  clocking x", 4, 4), ("  recording y", 4, 4), ("  clocking y", 4, 4),
        ("  repeat 1/2", 8, 8), ("  repeat 2/2", 8, 8)]
    assert bars.bars[4]["postfix"] == ["x", "y"] and bars.bars[5]["postfix"] == ["y", "x"]  # which configuration


def test_log_progress_prints_lines_for_logs_at_most_every_interval():
    import io

    from dllm.eval.study import bench

    out = io.StringIO()
    with bench.LogProgress(3, "  repeat 1/2", interval=0.0, out=out) as shown:
        shown.set_postfix_str("fef w4")
        for _ in range(3):
            shown.update()
    assert out.getvalue().splitlines() == ["  repeat 1/2 (fef w4): batch 1/3", "  repeat 1/2 (fef w4): batch 2/3"]
    quiet = io.StringIO()
    with bench.LogProgress(3, "x", interval=3600.0, out=quiet) as shown:
        shown.update(3)
    assert quiet.getvalue() == ""
