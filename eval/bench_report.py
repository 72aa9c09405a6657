"""Tables and plots of a ``dllm bench`` study: results.md, the printed table, and the PNG figures."""

from __future__ import annotations

import math
from pathlib import Path

from dllm.eval import cost_model
from dllm.samplers import SAMPLERS

COLUMNS = (  # (header, key, format) of the printed and markdown tables
    ("configuration", "name", "{}"), ("sampler", "sampler", "{}"), ("exact", "exact", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"), ("x baseline", "speedup", "{:.2f}"),
    ("(min-max)", "speedup_range", "{}"), ("s/sample", "s_per_sample", "{:.3f}"),
    ("NFE", "nfe", "{}"), ("NFE draft", "nfe_draft", "{}"), ("fwd tok/tok", "forward_tokens_per_token", "{:.1f}"),
    ("tok/call", "tokens_per_call", "{:.2f}"), ("tok/row-call", "tokens_per_row_call", "{:.2f}"),
    ("acc. len", "mean_acceptance_length", "{:.2f}"), ("accuracy", "accuracy", "{:.3f}"),
)


def table_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for run in runs:
        run = {**run, "speedup_range": f"{run['speedup_min']:.2f}-{run['speedup_max']:.2f}"}
        rows.append(["-" if run[key] is None else fmt.format(run[key]) for _, key, fmt in COLUMNS])
    return rows


def markdown(results: dict) -> str:
    """results.md: settings, the main table, and per-position acceptance of speculative configurations."""
    s = results["settings"]
    head = [h for h, _, _ in COLUMNS]
    lines = [
        "# dllm bench", "",
        f"{results['machine']['processor']} ({results['machine']['device_name']}), torch {results['torch_version']}, "
        f"{results['dtype']}, {results['threads']} threads. Prompts: {results['prompts']['source']} "
        f"x {results['prompts']['count']}, max_new_tokens {s['max_new_tokens']}, batch size {s['batch_size']}, "
        f"{results.get('repeats_completed', s['repeats'])} timed repeats (median; speedup = median per-repeat "
        f"ratio to `{results['baseline']}`)."
        + (f" **Interrupted** after {results['repeats_completed']} of {s['repeats']} repeats."
           if results.get("interrupted") else ""), "",
        "| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results["runs"])]
    speculative = [r for r in results["runs"] if r["acceptance_per_position"]]
    if speculative:
        width = max(len(r["acceptance_per_position"]) for r in speculative)
        lines += ["", "Acceptance by window position (P(drafts 0..j accepted | j proposed)):", "",
                  "| configuration | " + " | ".join(str(j) for j in range(width)) + " |",
                  "|" + " --- |" * (width + 1)]
        for r in speculative:
            cells = [f"{a:.2f}" for a in r["acceptance_per_position"]] + [""] * width
            lines.append(f"| {r['name']} | " + " | ".join(cells[:width]) + " |")
    return "\n".join(lines) + "\n"


def print_table(runs: list[dict]) -> None:
    head = [h for h, _, _ in COLUMNS]
    rows = table_rows(runs)
    widths = [max(len(x) for x in column) for column in zip(head, *rows)]
    for row in [head, *rows]:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))


# --------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------


MARKERS = {"ar": "s", "ar_spec": "D", "sequential": "v", "fef": "o"}  # other samplers: "^"


def plot_pareto(plt, runs: list[dict], path: Path) -> None:
    """Accuracy against tokens/s (min-max over repeats as error bars), with the Pareto front.

    Points carry their configuration's number (legend on the right): names would overlap.
    """
    fig, ax = plt.subplots(figsize=(10, 5.5))
    scored = all(r["accuracy"] is not None for r in runs)
    key = "accuracy" if scored else "tokens_per_row_call"
    colours = plt.get_cmap("tab20")
    for i, run in enumerate(runs):
        x, y = run["tokens_per_s"], run[key]
        err = [[x - run["tokens_per_s_min"]], [run["tokens_per_s_max"] - x]]
        ax.errorbar(x, y, xerr=err, fmt=MARKERS.get(run["sampler"], "^"), color=colours(i % 20), capsize=3,
                    label=f"{i + 1}. {run['name']}")
        ax.annotate(str(i + 1), (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    front = _pareto_front([(r["tokens_per_s"], r[key]) for r in runs])
    ax.plot(*zip(*front), "k--", lw=0.8, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("response tokens / s (median; bars: min-max over repeats)")
    ax.set_ylabel("accuracy" if scored else "tokens per row-call (prompts unscored)")
    ax.set_title("Accuracy vs speed" if scored else "Tokens per call vs speed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes, by increasing speed."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return sorted(front)


def plot_calls(plt, runs: list[dict], path: Path) -> None:
    """Tokens per row-call and forward tokens per generated token, one bar per configuration."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(runs) + 1.5), sharey=True)
    names = [r["name"] for r in runs]
    colours = [plt.get_cmap("tab10")(list(SAMPLERS).index(r["sampler"]) % 10) for r in runs]
    axes[0].barh(names, [r["tokens_per_row_call"] for r in runs], color=colours)
    axes[0].set_xlabel("tokens per row-call (new tokens / sequences served by target calls)")
    axes[1].barh(names, [r["forward_tokens_per_token"] for r in runs], color=colours, label="target")
    axes[1].barh(names, [r["forward_tokens_draft_per_token"] for r in runs], color="white", edgecolor="black",
                 hatch="//", left=[r["forward_tokens_per_token"] for r in runs], label="drafter")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("forward tokens per generated token")
    axes[1].legend(fontsize=8)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(plt, runs: list[dict], path: Path) -> None:
    """P(drafts 0..j all accepted | j proposed) against window position j, per speculative configuration."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in runs:
        accept = run["acceptance_per_position"]
        if accept:
            ax.plot(range(len(accept)), accept, "o-", label=run["name"])
    ax.set_xlabel("window position j")
    ax.set_ylabel("acceptance (drafts 0..j accepted)")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative configuration", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(runs: list[dict], folder: Path) -> list[str]:
    plt = cost_model.pyplot()
    if plt is None:
        return []
    plots = {"pareto.png": plot_pareto, "tokens_per_call.png": plot_calls, "acceptance.png": plot_acceptance}
    for name, plot in plots.items():
        plot(plt, runs, folder / name)
    return list(plots)
