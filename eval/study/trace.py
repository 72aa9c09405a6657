"""The trajectory of one generation, round by round, as an HTML table or a PNG text grid.

    trace = TraceRecorder()
    out = dllm.generate(model, prompt, sampler="fef", callback=trace, ...)
    render_trace(trace.events, tokenizer, "trace.html", prompt_length=prompt.shape[1])   # or "trace.png"

One line per round (a sampler step), one column per answer position, each token shown as its decoded
text piece and coloured by what happened to it in that round: accepted draft, correction or bonus (or,
for non-speculative samplers, revealed this step), rejected or re-masked draft, still masked, or
revealed earlier. A correction that replaced a rejected draft keeps the draft as a note (HTML tooltip
and struck-through text; small red text in the PNG), and so does a draft tree's taken sibling
(``StepEvent.branch``): ar_spec's leaf token after it is shown as a bonus, and fef's branch after it (on a
two-stream model) as accepted drafts, then a correction or bonus. Reads the callback events every sampler sends
(see ``dllm.samplers``): fef and the masked-diffusion samplers, ``ar`` and ``ar_spec``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dllm.stats import StepEvent

KINDS = {  # kind -> (legend label, background colour)
    "accepted": ("accepted draft", "#a8dba0"),
    "fixed": ("correction / bonus (or revealed this step)", "#9cc6f2"),
    "rejected": ("rejected / re-masked draft", "#f2a0a0"),
    "masked": ("still masked", "#d9d9d9"),
    "done": ("revealed earlier", "#ffffff"),
}


class TraceRecorder:
    """A ``generate`` callback that keeps a CPU copy of every event (samplers reuse their buffers)."""

    def __init__(self):
        self.events: list[StepEvent] = []

    def __call__(self, event: StepEvent) -> None:
        self.events.append(event.detached())


@dataclass
class Cell:
    """One answer position in one round."""

    token: int | None  # None: masked
    kind: str
    note: int | None = None  # a rejected draft the correction replaced


@dataclass
class Round:
    summary: str
    cells: list[Cell] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------------
# Events -> rounds
# --------------------------------------------------------------------------------------------------------


def trace_rounds(events: Sequence[StepEvent], *, prompt_length: int | None = None, row: int = 0,
                 mask_token_id: int | None = None, eos_token_id: int | Sequence[int] | None = None) -> list[Round]:
    """The rounds of canvas row ``row``: answer positions from ``prompt_length`` on, classified."""
    mine = [(event, _index(event, row)) for event in events]
    mine = [(event, i) for event, i in mine if i is not None]
    if not mine:
        raise ValueError(f"no event mentions row {row}")
    sampler = mine[0][0].sampler
    if sampler == "ar_spec":
        if prompt_length is None:
            raise ValueError("an ar_spec trace needs prompt_length= (its buffer does not show where the prompt ends)")
        return _ar_spec_rounds(mine, prompt_length, eos_token_id)
    if sampler == "ar":
        start = prompt_length if prompt_length is not None else mine[0][0].x.shape[1] - 1
        return [_ar_round(event.x[i].tolist(), start) for event, i in mine]
    if mask_token_id is None:
        raise ValueError("a diffusion trace needs the mask token id: pass mask_token_id= or a tokenizer with one")
    start = prompt_length if prompt_length is not None else _answer_start(*mine[0], mask_token_id)
    return [_diffusion_round(event, i, start, mask_token_id) for event, i in mine]


def _index(event: StepEvent, row: int) -> int | None:
    """Where canvas row ``row`` sits among the event's active rows (None if it is not active)."""
    rows = event.rows.tolist()
    return rows.index(row) if row in rows else None


def _answer_start(event: StepEvent, i: int, mask_id: int) -> int:
    """After the first round, the answer starts at the first position that is masked or was just revealed."""
    x = event.x[i]
    candidates = (x == mask_id).nonzero().flatten().tolist() + _revealed(event, i)
    return min(candidates)


def _revealed(event: StepEvent, i: int) -> list[int]:
    """Canvas positions revealed this round (fef/sequential give positions, -1 = none; others a view mask)."""
    revealed = event.revealed[i]
    if revealed.dtype == torch.bool:
        return (revealed.nonzero().flatten() + event.offset).tolist()
    return [p for p in revealed.tolist() if p >= 0]


def _diffusion_round(event: StepEvent, i: int, start: int, mask_id: int) -> Round:
    x = event.x[i].tolist()
    cells = [Cell(None, "masked") if t == mask_id else Cell(t, "done") for t in x]
    emitted = _revealed(event, i)
    if event.window is None:  # a non-speculative step: what it revealed
        for p in emitted:
            cells[p].kind = "fixed"
        return Round(f"{len(emitted)} revealed", cells[start:])
    window, drafts = event.window[i].tolist(), event.drafts[i].tolist()
    drafted, accepted = int(event.num_drafts[i]), int(event.num_accepted[i])
    for k, p in enumerate(emitted):  # emitted in order: the accepted drafts, then the correction/bonus
        cells[p].kind = "accepted" if k < accepted else "fixed"
    if _took_sibling(event, i):  # the taken sibling replaced the chain's rejected draft there
        cells[window[int(event.branch_depth[i])]].note = int(event.replaced[i])
    for j in range(accepted, drafted):  # the first rejected draft (of the path), and those after it
        cell = cells[window[j]]
        if cell.kind == "fixed":
            cell.note = drafts[j]
        elif cell.token is None:
            cells[window[j]] = Cell(drafts[j], "rejected")
    extra = len(emitted) - accepted
    return Round(f"{drafted} drafted, {accepted} accepted" + (f", +{extra}" if extra else ""), cells[start:])


def _took_sibling(event: StepEvent, i: int) -> bool:
    """Whether row ``i`` took a draft tree's sibling this round (``StepEvent.branch``)."""
    return event.branch is not None and int(event.branch[i]) > 0


def _ar_round(x: list[int], start: int) -> Round:
    cells = [Cell(t, "done") for t in x[start:]]
    cells[-1].kind = "fixed"
    return Round("1 token", cells)


def _ar_spec_rounds(mine, start: int, eos: int | Sequence[int] | None) -> list[Round]:
    """ar_spec: each row's length advances by the accepted drafts plus one correction or bonus."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    rounds, length = [], start
    for event, i in mine:
        x, drafts = event.x[i].tolist(), event.drafts[i].tolist()
        drafted, accepted = int(event.num_drafts[i]), int(event.num_accepted[i])
        emitted = min(accepted + 1, len(x) - length)
        new = x[length : length + emitted]
        stop = next((k for k, t in enumerate(new) if t in stops), None)
        if stop is not None:  # the row stopped: nothing after its stop token was kept
            emitted = stop + 1
        cells = [Cell(t, "done") for t in x[start:length]]
        cells += [Cell(t, "accepted" if k < accepted else "fixed") for k, t in enumerate(x[length : length + emitted])]
        if _took_sibling(event, i) and emitted >= accepted:  # the sibling replaced the chain's draft there
            cells[length - start + int(event.branch_depth[i])].note = int(event.replaced[i])
            cells += [Cell(d, "rejected") for d in drafts[accepted:drafted]]
        else:
            if accepted < drafted and emitted > accepted:
                cells[-1].note = drafts[accepted]
            cells += [Cell(d, "rejected") for d in drafts[accepted + 1 : drafted]]
        rounds.append(Round(f"{drafted} drafted, {accepted} accepted, +{emitted - accepted}", cells))
        length += emitted
    return rounds


# --------------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------------


def drop_after_stop(rounds: list[Round], stop_token_ids: Sequence[int] | None) -> list[Round]:
    """The rounds without the columns after the row's first stop token in its last round (fill, not answer)."""
    stops = set(stop_token_ids or ())
    final = rounds[-1].cells
    stop = next((j for j, cell in enumerate(final) if cell.token in stops), None)
    if stop is None:
        return rounds
    return [Round(r.summary, r.cells[: stop + 1]) for r in rounds]


def check_trace_path(path: str | Path) -> Path:
    """The trace file as a Path, once its suffix is one we write and, for .png, matplotlib imports
    (checked before decoding, so a missing library does not cost the run)."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm", ".png"):
        raise ValueError(f"a trace file must end in .html or .png, got {path.name!r}")
    if path.suffix.lower() == ".png":
        from dllm.extras import require

        require("matplotlib", "bench", f"the trace {path.name} (an .html trace does not)")
    return path


def render_trace(events: Sequence[StepEvent], tokenizer, path: str | Path, *, prompt_length: int | None = None,
                 row: int = 0, mask_token_id: int | None = None, title: str | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> Path:
    """Write the trajectory of canvas row ``row`` to ``path``: ``.html`` (a table) or ``.png`` (a text grid).

    tokenizer: a Hugging Face tokenizer, a sequence of strings (token id -> text), a callable, or None
    (ids shown). ``prompt_length`` is inferred for diffusion and ``ar`` traces; ``mask_token_id`` and
    the stop ids (``stop_token_ids``: the row ends at the first; later columns are dropped) default to
    the tokenizer's mask and EOS ids.
    """
    path = check_trace_path(path)
    mask_token_id = mask_token_id if mask_token_id is not None else getattr(tokenizer, "mask_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    stops = tuple(stop_token_ids) if stop_token_ids is not None else (() if eos is None else (eos,))
    rounds = trace_rounds(events, prompt_length=prompt_length, row=row, mask_token_id=mask_token_id,
                          eos_token_id=stops)
    title = title or f"{events[0]['sampler']} trajectory, row {row}"
    prompt = _prompt_text(events, rounds, row, tokenizer, prompt_length)  # before columns are dropped
    rounds = drop_after_stop(rounds, stops)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        _png(rounds, tokenizer, title, prompt, path)
    else:
        path.write_text(_html(rounds, tokenizer, title, prompt), encoding="utf-8")
    return path


def _prompt_text(events, rounds: list[Round], row: int, tokenizer, prompt_length: int | None) -> str:
    event = next(e for e in events if _index(e, row) is not None)
    x = event.x[_index(event, row)].tolist()
    length = prompt_length if prompt_length is not None else len(x) - len(rounds[0].cells)
    return "".join(_text(tokenizer, t) for t in x[:length])


def _text(tokenizer, token: int) -> str:
    """The decoded text of one token id."""
    if tokenizer is None:
        return f"[{token}]"
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode([token])
    if isinstance(tokenizer, Sequence):
        return tokenizer[token] if 0 <= token < len(tokenizer) else f"[{token}]"
    return str(tokenizer(token))


def _piece(tokenizer, token: int | None, limit: int | None = None) -> str:
    """A token's text made visible in a cell: spaces and newlines shown, special tokens shortened."""
    if token is None:
        return ""
    text = _text(tokenizer, token)
    if text.startswith("<|") and text.endswith("|>"):
        text = f"<{text[2:-2]}>"
    text = text.replace(" ", "\u2423").replace("\n", "\u23ce")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) or "\u2205"
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "\u2026"


def _html(rounds: list[Round], tokenizer, title: str, prompt: str) -> str:
    width = max(len(r.cells) for r in rounds)
    style = "".join(f".{k}{{background:{colour}}}" for k, (_, colour) in KINDS.items())
    legend = " ".join(f'<span class="key {k}">{html.escape(label)}</span>' for k, (label, _) in KINDS.items())
    head = "".join(f"<th>{j}</th>" for j in range(width))
    body = "\n".join(f"<tr><td class=meta>{n + 1}</td><td class=meta>{html.escape(r.summary)}</td>"
                     + "".join(_html_cell(c, tokenizer) for c in r.cells) + "</tr>" for n, r in enumerate(rounds))
    final = "".join(_text(tokenizer, c.token) for c in rounds[-1].cells if c.token is not None)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body{{font-family:sans-serif;margin:1em}} table{{border-collapse:collapse;font:12px monospace}}
td,th{{border:1px solid #bbb;padding:1px 4px;text-align:center;white-space:pre}} th{{background:#f3f3f3}}
td.meta{{text-align:left;background:#f8f8f8}} .key{{padding:2px 6px;border:1px solid #bbb;margin-right:4px}}
.rejected,s{{text-decoration:line-through;color:#900}} {style}
</style></head><body>
<h2>{html.escape(title)}</h2>
<p><b>prompt:</b> <code>{html.escape(prompt)}</code></p>
<p>{legend}</p>
<table><tr><th>round</th><th>what happened</th>{head}</tr>
{body}
</table>
<p><b>final answer:</b></p><pre>{html.escape(final)}</pre>
</body></html>
"""


def _html_cell(cell: Cell, tokenizer) -> str:
    tip = "masked" if cell.token is None else f"id {cell.token}, {KINDS[cell.kind][0]}"
    text = html.escape(_piece(tokenizer, cell.token))
    if cell.note is not None:
        tip += f"; replaced rejected draft {_text(tokenizer, cell.note)!r}"
        text = f"<s>{html.escape(_piece(tokenizer, cell.note))}</s> {text}"
    return f'<td class="{cell.kind}" title="{html.escape(tip)}">{text}</td>'


def _png(rounds: list[Round], tokenizer, title: str, prompt: str, path: Path) -> None:
    """A text grid: one row per round, one column per answer position, cells coloured by kind."""
    from dllm.extras import require

    require("matplotlib", "bench", "a PNG trace (an .html one does not)").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    width, height, meta = max(len(r.cells) for r in rounds), len(rounds), 4.0  # meta: columns of the summary
    top = 0.95  # inches above the grid for the title, the prompt and the legend
    legend_width = 9.0  # inches the one-line legend needs; a short answer must not cut it off
    fig = plt.figure(figsize=(max(0.55 * (width + meta) + 0.3, legend_width), 0.36 * height + top + 0.1))
    inches = fig.get_figheight()
    ax = fig.add_axes((0.005, 0.1 / inches, 0.99, 1 - (top + 0.1) / inches))
    for n, r in enumerate(rounds):
        ax.text(0.1, n + 0.5, f"{n + 1:>3}  {r.summary}", va="center", fontsize=7, family="monospace")
        for j, cell in enumerate(r.cells):
            ax.add_patch(Rectangle((meta + j, n), 1, 1, facecolor=KINDS[cell.kind][1], edgecolor="#999", lw=0.4))
            ax.text(meta + j + 0.5, n + 0.45, _piece(tokenizer, cell.token, 6), ha="center", va="center",
                    fontsize=7, family="monospace", parse_math=False)
            if cell.note is not None:
                ax.text(meta + j + 0.5, n + 0.84, "\u2717" + _piece(tokenizer, cell.note, 5), ha="center",
                        va="center", fontsize=6, color="#b00000", family="monospace", parse_math=False)
    ax.set_xlim(0, (fig.get_figwidth() - 0.3) / 0.55)  # cells keep their size when the legend widens the figure
    ax.set_ylim(height, 0)
    ax.axis("off")
    shown = prompt.replace("\n", "\u23ce")
    shown = shown if len(shown) < 160 else "\u2026" + shown[-159:]
    fig.text(0.005, 1 - 0.08 / inches, f"{title}\nprompt: {shown}", fontsize=9, va="top", parse_math=False)
    handles = [Patch(facecolor=colour, edgecolor="#999", label=label) for label, colour in KINDS.values()]
    fig.legend(handles=handles, loc="lower left", ncol=len(handles), fontsize=7, frameon=False,
               bbox_to_anchor=(0.0, 1 - (top - 0.05) / inches))
    fig.savefig(path, dpi=100)
    plt.close(fig)
