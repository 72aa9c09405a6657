"""Read evaluation folders: parse samples.jsonl, recompute a run's summary, compare runs (`dllm eval report`).

A folder written by `dllm.eval.runner` holds `run.json` (the run's identity and one record per attempt),
`samples.jsonl` (one line per problem and sample, written a whole batch at a time) and `summary.json`.
Everything here reads only those files, so a summary can be rebuilt without the model.

    dllm eval report DIR [DIR...] [--png FILE]   # markdown table on stdout, accuracy-vs-speed chart as PNG
                                                 # (default: DIR/eval_report.png; several runs: their parent)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dllm.eval.tasks import get_task
from dllm.stats import DecodeStats

__all__ = ["chart_path", "load_samples", "main", "markdown_table", "parse_samples", "plot_runs", "summarize_folder"]

RUN_FILE, SAMPLES_FILE, SUMMARY_FILE = "run.json", "samples.jsonl", "summary.json"
CHART_FILE = "eval_report.png"  # `dllm eval report`'s chart, beside the runs it compares (chart_path)


def parse_samples(data: bytes) -> tuple[list[dict], int]:
    """The rows of whole batches at the start of a samples file, and how many bytes they span.

    A line counts only when it ends in a newline and holds a JSON object; reading stops at the first
    line that does not (a write cut short by a kill). A batch's lines are written in one go, so only the
    last batch can be incomplete: its rows are dropped too (fewer lines than its `batch.rows`), keeping
    every batch's stats counted once and whole.
    """
    rows, ends = [], []
    start = 0
    while (newline := data.find(b"\n", start)) >= 0:
        try:
            row = json.loads(data[start:newline])
        except ValueError:
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
        start = newline + 1
        ends.append(start)
    keep = _whole_batches(rows)
    return rows[:keep], ends[keep - 1] if keep else 0


def _whole_batches(rows: list[dict]) -> int:
    """How many leading rows to keep: all but a trailing batch with fewer rows than it declares."""
    if not rows:
        return 0
    last = rows[-1]["batch"]
    first = len(rows)
    while first > 0 and rows[first - 1]["batch"]["id"] == last["id"]:
        first -= 1
    return len(rows) if len(rows) - first == last["rows"] else first


def load_samples(path: str | Path) -> list[dict]:
    """The complete rows of a samples file (none when it does not exist); the file is not changed."""
    path = Path(path)
    return parse_samples(path.read_bytes())[0] if path.is_file() else []


def summed_stats(rows: Sequence[dict]) -> DecodeStats:
    """DecodeStats summed over the batches the rows came from, each batch counted once."""
    total = DecodeStats()
    fields = DecodeStats.__dataclass_fields__
    seen: set[str] = set()
    for row in rows:
        batch = row["batch"]
        if batch["id"] not in seen:
            seen.add(batch["id"])
            total = total + DecodeStats(**{k: v for k, v in batch["stats"].items() if k in fields})
    return total


def summarize_folder(folder: str | Path) -> dict:
    """The summary of an evaluation folder, computed from run.json and samples.jsonl alone."""
    folder = Path(folder)
    run = json.loads((folder / RUN_FILE).read_text())
    identity, latest = run["identity"], run["attempts"][-1]
    rows = load_samples(folder / SAMPLES_FILE)
    task = get_task(identity["task"], **identity["task_options"])
    metrics = {"accuracy": sum(bool(r["correct"]) for r in rows) / len(rows) if rows else 0.0}
    metrics.update(task.summarize(rows) if rows else {})
    speed = summed_stats(rows).to_dict()
    return {
        "task": identity["task"],
        "model": identity["model"],
        "sampler": identity["sampler"],
        "sampler_options": identity["sampler_options"],
        "exact": all(r["batch"]["exact"] for r in rows),
        "metrics": metrics,
        "counts": {
            "samples": len(rows),
            "problems": len({r["id"] for r in rows}),
            "correct": sum(bool(r["correct"]) for r in rows),
            "batches": len({r["batch"]["id"] for r in rows}),
            "planned_samples": latest["planned_samples"],
        },
        "complete": len(rows) >= latest["planned_samples"],
        "speed": speed,
        "config": identity,
        "environment": latest,
        "attempts": len(run["attempts"]),
    }


def _headline(summary: dict) -> tuple[str, float]:
    """The metric a run is ranked by: pass@1 for code tasks, else accuracy."""
    metrics = summary["metrics"]
    name = "pass@1" if "pass@1" in metrics else "accuracy"
    return name, metrics.get(name, 0.0)


def _options_text(summary: dict) -> str:
    """The sampler options the run set explicitly (the rest are the sampler's defaults)."""
    given = summary["config"].get("options", {})
    return ", ".join(f"{k}={v}" for k, v in given.items()) or "defaults"


def markdown_table(summaries: Sequence[dict], folders: Sequence[str | Path] | None = None) -> str:
    """One row per run, named by its folder: task x sampler with accuracy, speed, NFE and acceptance length.
    The token budget is shown: `dllm eval`'s default depends on the context and the longest prompt.

    Runs that differ only in what the table does not show (seed, dtype, task options) stay told apart.
    """
    folders = folders if folders is not None else ["-"] * len(summaries)
    header = ("| run | task | sampler | options | model | T | new tokens | n | metric | score | tokens/s | NFE "
              "| tokens/call | acceptance length |")
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for folder, s in zip(folders, summaries):
        name, value = _headline(s)
        speed = s["speed"]
        lines.append(
            f"| {folder} | {s['task']} | {s['sampler']} | {_options_text(s)} | {Path(str(s['model'])).name} "
            f"| {s['config']['temperature']:g} | {s['config'].get('max_new_tokens', '-')} | {s['counts']['samples']} "
            f"| {name} | {value:.3f} "
            f"| {speed['tokens_per_second']:.1f} | {speed['nfe']} | {speed['tokens_per_call']:.2f} "
            f"| {speed['mean_acceptance_length']:.2f} |"
        )
    return "\n".join(lines)


def plot_runs(summaries: Sequence[dict], path: str | Path, folders: Sequence[str | Path] | None = None) -> Path:
    """Save a scatter chart of score against response tokens per second, one point per run (named by folder)."""
    from dllm.extras import require

    require("matplotlib", "eval", "the runs' plot").use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [Path(str(f)).name for f in folders] if folders is not None else \
        [f"{s['sampler']} ({_options_text(s)})" for s in summaries]
    tasks = sorted({s["task"] for s in summaries})
    for index, task in enumerate(tasks):
        runs = [(s, n) for s, n in zip(summaries, names) if s["task"] == task]
        xs = [s["speed"]["tokens_per_second"] for s, _ in runs]
        ys = [_headline(s)[1] for s, _ in runs]
        ax.scatter(xs, ys, label=task, color=f"C{index}")
        for (_, name), x, y in zip(runs, xs, ys):
            ax.annotate(name, (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    fastest = max((s["speed"]["tokens_per_second"] for s in summaries), default=1.0) or 1.0
    ax.set_xlim(0, fastest * 1.3)  # room for the last point's label
    ax.set_ylim(-0.02, 1.1)  # scores are fractions: keep runs on one scale (and labels above 1.0 inside)
    ax.set_xlabel("response tokens / s")
    ax.set_ylabel("accuracy (pass@1 for code)")
    ax.set_title("accuracy against decoding speed")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """`dllm eval report DIR [DIR...]`: print the table, save the chart."""
    parser = argparse.ArgumentParser(prog="dllm eval report", description="Compare evaluation runs.")
    parser.add_argument("folders", nargs="+", metavar="DIR", help="output folders of dllm eval runs")
    parser.add_argument("--png", help=f"where to save the accuracy-vs-speed chart (default: {CHART_FILE} beside "
                                      "the results: in DIR for one run, in the runs' common folder for several)")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not (Path(f) / RUN_FILE).is_file()]
    if missing:
        print(f"dllm eval: not evaluation folders (no {RUN_FILE}): {', '.join(missing)}", file=sys.stderr)
        return 2
    summaries = [summarize_folder(f) for f in args.folders]
    print(markdown_table(summaries, args.folders))
    try:
        chart = plot_runs(summaries, args.png or chart_path(args.folders), args.folders)
    except ImportError as error:
        if args.png:  # asked for by name: not drawing it is a failure
            raise
        print(f"dllm eval report: no chart: {error}", file=sys.stderr)  # the table above is the report
        return 0
    print(f"\nchart: {chart}")
    return 0


def chart_path(folders: Sequence[str | Path]) -> Path:
    """The chart's default place, beside the results: inside the one run's folder, or in the folder that
    holds all the runs compared (never the current directory unless the runs are there)."""
    if len(folders) == 1:
        return Path(folders[0]) / CHART_FILE
    return Path(os.path.commonpath([Path(f).resolve() for f in folders])) / CHART_FILE


if __name__ == "__main__":
    sys.exit(main())
