"""Tables and plots of a ``dllm bench`` study: results.md, the printed table, and the PNG figures."""

from __future__ import annotations

import math
from pathlib import Path

from dllm.eval.study import cost_model
from dllm.samplers import SAMPLERS

COLUMNS = (  # (header, key, format) of the printed and markdown tables
    ("configuration", "name", "{}"), ("sampler", "sampler", "{}"), ("exact", "exact", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"), ("x baseline", "speedup", "{:.2f}"),
    ("(min-max)", "speedup_range", "{}"), ("s/sample", "s_per_sample", "{:.3f}"),
    ("NFE", "nfe", "{}"), ("NFE draft", "nfe_draft", "{}"), ("fwd tok/tok", "forward_tokens_per_token", "{:.1f}"),
    ("tok/call", "tokens_per_call", "{:.2f}"), ("tok/row-call", "tokens_per_row_call", "{:.2f}"),
    ("acc. len", "mean_acceptance_length", "{:.2f}"), ("tau", "tokens_per_draft_round", "{:.2f}"),
    ("non-model", "non_model_share", "{:.0%}"), ("accuracy", "accuracy", "{:.3f}"),
    ("syncs/step", "syncs_per_step", "{:.1f}"),
)


def table_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for run in runs:
        run = {**run, "speedup_range": f"{run['speedup_min']:.2f}-{run['speedup_max']:.2f}"}
        rows.append(["-" if run.get(key) is None else fmt.format(run[key]) for _, key, fmt in COLUMNS])
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
    lines += entropy_lines(results["runs"])
    return "\n".join(lines) + "\n"


def entropy_lines(runs: list[dict]) -> list[str]:
    """results.md's acceptance-vs-entropy section: the fit per configuration, then acceptance by entropy bin."""
    fitted = [r for r in runs if r.get("acceptance_vs_entropy")]
    if not fitted:
        return []
    number = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["", "Acceptance against the target's entropy (each draft verification tested; entropy in nats of the "
             "target's temperature-1 distribution there; least-squares line of acceptance, 0 or 1, on entropy):", "",
             "| configuration | T | drafts | acceptance | slope | intercept |", "|" + " --- |" * 6]
    for r in fitted:
        fit = r["acceptance_vs_entropy"]
        lines.append(f"| {r['name']} | {r['temperature']:g} | {fit['num_drafts']} | {number(fit['acceptance'])} | "
                     f"{number(fit['slope'])} | {number(fit['intercept'])} |")
    width = fitted[0]["acceptance_vs_entropy"]["bin_nats"]
    top = max(b["low"] for r in fitted for b in r["acceptance_vs_entropy"]["bins"])
    edges = [k * width for k in range(round(top / width) + 1)]
    lines += ["", "Acceptance (drafts) by entropy bin, nats:", "",
              "| configuration | " + " | ".join(f"{e:g}-{e + width:g}" for e in edges) + " |",
              "|" + " --- |" * (len(edges) + 1)]
    for r in fitted:
        bins = {round(b["low"] / width): b for b in r["acceptance_vs_entropy"]["bins"]}
        cells = [f"{bins[k]['acceptance']:.2f} ({bins[k]['num_drafts']})" if k in bins else ""
                 for k in range(len(edges))]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


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
LABEL_SPACING = 11.0  # points between two labels' anchors: font size 8 plus a margin


def pareto_figure(plt, runs: list[dict]):
    """The Pareto figure: numbered points (legend on the right: names would overlap), labels kept apart, the
    front as a staircase through its points (the best accuracy reached at that speed or faster), plain-number log ticks.
    """
    fig, ax = plt.subplots(figsize=(10, 5.5))
    scored = all(r["accuracy"] is not None for r in runs)
    key = "accuracy" if scored else "tokens_per_row_call"
    colours = plt.get_cmap("tab20")
    points = [(r["tokens_per_s"], r[key]) for r in runs]
    handles = []  # the legend shows what is drawn: each run's marker (its bars may have no length), the front
    for i, (run, (x, y)) in enumerate(zip(runs, points)):
        err = [[x - run["tokens_per_s_min"]], [run["tokens_per_s_max"] - x]]
        drawn = ax.errorbar(x, y, xerr=err, fmt=MARKERS.get(run["sampler"], "^"), color=colours(i % 20), capsize=3)
        handles.append(drawn.lines[0])
    front = _pareto_front(points)
    # One line for the front, its points ringed; a front of one point has no line to draw, so none in its legend.
    handles += ax.plot(*zip(*front), color="k", linestyle="--" if len(front) > 1 else "none", lw=0.9,
                       drawstyle="steps-pre", marker="o", ms=13, mfc="none", mec="k", mew=0.8, zorder=1,
                       label="Pareto front")
    ax.set_xscale("log")
    ax.margins(x=0.08, y=0.12)
    ax.autoscale_view()
    ticks = _log_ticks(*ax.get_xlim())
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    anchors = ax.transData.transform(points) * 72 / fig.dpi  # in points, where label spacing is measured
    for i, ((x, y), offset) in enumerate(zip(points, label_offsets(anchors.tolist(), LABEL_SPACING))):
        ax.annotate(str(i + 1), (x, y), fontsize=8, xytext=offset, textcoords="offset points")
    ax.set_xlabel("response tokens / s (median; bars: min-max over repeats; log scale)")
    ax.set_ylabel("accuracy" if scored else "tokens per row-call (prompts unscored)")
    ax.set_title("Accuracy vs speed" if scored else "Tokens per call vs speed")
    labels = [f"{i + 1}. {run['name']}" for i, run in enumerate(runs)] + ["Pareto front"]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes, by increasing speed."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return sorted(front)


def _log_ticks(low: float, high: float) -> list[float]:
    """Readable ticks for a log axis over [low, high]: 1-2-5 per decade, finer when that gives fewer than 3."""
    for subs in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), tuple(1 + k / 10 for k in range(90))):
        ticks = [round(m * 10.0 ** e, 12) for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                 for m in subs if low <= m * 10.0 ** e <= high]
        if len(ticks) >= 3:
            return _thin(ticks, 8)
    return [low, high]


def _thin(ticks: list[float], most: int) -> list[float]:
    """Every k-th tick, so at most ``most`` remain."""
    step = math.ceil(len(ticks) / most)
    return ticks[::step]


def label_offsets(anchors: list[list[float]], spacing: float) -> list[tuple[float, float]]:
    """Offsets (points) for labels at ``anchors`` (points) so no two labels sit closer than ``spacing``.

    Greedy, in order: each label takes the first candidate position (right-above the point first, then
    stepping around it further out) that keeps ``spacing`` from every label already placed.
    """
    candidates = [(4.0, 4.0)] + [(dx * r, dy * r) for r in (1, 2, 3, 4, 5)
                                 for dx, dy in ((4, -11), (-12, 4), (-12, -11), (4, 14), (4, -22), (16, 4))]
    placed: list[tuple[float, float]] = []
    offsets = []
    for x, y in anchors:
        for dx, dy in candidates:
            if all(math.hypot(x + dx - px, y + dy - py) >= spacing for px, py in placed):
                break
        placed.append((x + dx, y + dy))
        offsets.append((dx, dy))
    return offsets


def calls_figure(plt, runs: list[dict]):
    """The tokens-per-call figure. Both axes are linear from 0: every bar shows (a log axis starts above the
    smallest bar, ar's, and hides it) and the drafter's part stacked on the target's keeps its true length.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(runs) + 1.5), sharey=True)
    names, colours = [r["name"] for r in runs], _sampler_colours(plt, runs)
    axes[0].barh(names, [r["tokens_per_row_call"] for r in runs], color=colours)
    axes[0].set_xlabel("tokens per row-call (new tokens / sequences served by target calls)")
    _forward_tokens(axes[1], names, runs, colours)
    axes[1].legend(fontsize=8)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def _sampler_colours(plt, runs: list[dict]) -> list:
    """One colour per sampler family, the same in every figure."""
    return [plt.get_cmap("tab10")(list(SAMPLERS).index(r["sampler"]) % 10) for r in runs]


def _forward_tokens(ax, names: list[str], runs: list[dict], colours: list) -> None:
    """Forward tokens per generated token as bars, the drafter's (hatched) stacked on the target's."""
    target = [r["forward_tokens_per_token"] for r in runs]
    ax.barh(names, target, color=colours, label="target")
    ax.barh(names, [r["forward_tokens_draft_per_token"] for r in runs], color="white", edgecolor="black",
            hatch="//", left=target, label="drafter")
    ax.set_xlabel("forward tokens per generated token")


LINE_STYLES = ("-", "--", "-.", ":")
CURVE_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "<", ">")


def acceptance_figure(plt, runs: list[dict]):
    """The acceptance figure: each curve its own colour, marker and line style, nudged sideways a little so
    that identical curves (e.g. fef with and without a cache, exact alike) stay visible side by side.
    """
    fig, ax = plt.subplots(figsize=(9, 4.5))
    curves = [r for r in runs if r["acceptance_per_position"]]
    nudge = 0.3 / max(len(curves), 1)  # all nudges together span under a third of a position
    for k, run in enumerate(curves):
        accept = run["acceptance_per_position"]
        dx = (k - (len(curves) - 1) / 2) * nudge
        ax.plot([j + dx for j in range(len(accept))], accept, color=plt.get_cmap("tab10")(k % 10),
                marker=CURVE_MARKERS[k % len(CURVE_MARKERS)], linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                ms=5, label=run["name"])
    ax.set_xlabel("window position j (curves nudged sideways to stay apart)")
    ax.set_ylabel("acceptance (drafts 0..j accepted)")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(fig, ax, bool(ax.lines))


def entropy_figure(plt, runs: list[dict]):
    """Bebop's plot: per configuration, each entropy bin's acceptance at its mean entropy (marker area grows
    with the bin's drafts) and the least-squares line over the entropies seen, its slope in the legend."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    fitted = [r for r in runs if r.get("acceptance_vs_entropy")]
    most = max((b["num_drafts"] for r in fitted for b in r["acceptance_vs_entropy"]["bins"]), default=1)
    for k, run in enumerate(fitted):
        fit, colour = run["acceptance_vs_entropy"], plt.get_cmap("tab10")(k % 10)
        bins = fit["bins"]
        ax.scatter([b["mean_entropy"] for b in bins], [b["acceptance"] for b in bins], color=colour,
                   marker=CURVE_MARKERS[k % len(CURVE_MARKERS)], s=[12 + 60 * b["num_drafts"] / most for b in bins])
        label = f"{run['name']} (T={run['temperature']:g})"
        if fit["slope"] is not None:
            xs = [bins[0]["low"], bins[-1]["high"]]
            ax.plot(xs, [fit["slope"] * x + fit["intercept"] for x in xs], color=colour,
                    linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                    label=f"{label}: {fit['slope']:+.3f} per nat, {fit['intercept']:.3f} at 0")
        else:
            ax.scatter([], [], color=colour, label=f"{label}: one entropy only")
    ax.set_xlabel("target entropy at the draft's position (nats, temperature 1)")
    ax.set_ylabel("acceptance of the tested draft")
    ax.set_ylim(-0.05, 1.05)
    return _finish(fig, ax, bool(fitted))


def _finish(fig, ax, drawn: bool):
    """A grid, and the legend outside on the right, or a note where no configuration speculates."""
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative configuration", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def speed_figure(plt, runs: list[dict]):
    """The speed study side by side, one row per configuration: the speed-up, tokens per round, forward tokens per
    generated token (the drafter's stacked on the target's) and where the wall time goes (the target's calls,
    the drafter's, the rest: the round's non-model share, from the clocked pass)."""
    fig, axes = plt.subplots(1, 4, figsize=(15, 0.32 * len(runs) + 1.8), sharey=True)
    names, colours = [r["name"] for r in runs], _sampler_colours(plt, runs)
    axes[0].barh(names, [r["speedup"] for r in runs], color=colours,
                 xerr=[[r["speedup"] - r["speedup_min"] for r in runs],
                       [r["speedup_max"] - r["speedup"] for r in runs]])
    axes[0].axvline(1.0, color="black", linewidth=0.8)
    axes[0].set_xlabel("speed-up over the baseline (min-max of repeats)")
    axes[1].barh(names, [r["mean_acceptance_length"] for r in runs], color=colours)
    axes[1].set_xlabel("tokens per round (per row)")
    _forward_tokens(axes[2], names, runs, colours)
    axes[2].legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    shares = [r.get("model_share") or {"target": 0.0, "draft": 0.0} for r in runs]
    target = [s["target"] for s in shares]
    draft = [s["draft"] for s in shares]
    axes[3].barh(names, target, color="tab:blue", label="target calls")
    axes[3].barh(names, draft, left=target, color="tab:orange", label="drafter calls")
    axes[3].barh(names, [r.get("non_model_share") or 0.0 for r in runs], left=[t + d for t, d in zip(target, draft)],
                 color="tab:gray", label="non-model")
    axes[3].set_xlim(0, 1)
    axes[3].set_xlabel("share of wall time (clocked pass)")
    # the legends sit above the axes, where they hide no bar
    axes[3].legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def write_plots(runs: list[dict], folder: Path) -> list[str]:
    plt = cost_model.pyplot()
    if plt is None:
        return []
    # pareto: accuracy against tokens/s with the front; tokens_per_call: tokens per row-call and forward tokens
    # per generated token; acceptance: P(drafts 0..j accepted | j proposed) by window position; acceptance_entropy:
    # acceptance against the target's entropy; speed: speed-up, tokens per round, forward tokens per token and the
    # non-model share side by side
    plots = {"pareto.png": pareto_figure, "tokens_per_call.png": calls_figure, "acceptance.png": acceptance_figure,
             "acceptance_entropy.png": entropy_figure, "speed.png": speed_figure}
    for name, figure in plots.items():
        fig = figure(plt, runs)
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)
    return list(plots)
