"""The memory a decoding run will need, predicted from shapes before any weight is loaded (``dllm plan``).

    dllm plan --model llada-8b --batch-size 8 --max-new-tokens 1024 --prompt-length 30 --sampler fef --option window=8
    dllm plan --model PATH --sampler sequential          # a checkpoint folder's config.json (dllm, LLaDA, Dream)

A preset is a row of ``cost_model.ARCHS`` (``ARCH+blockN``: block-causal in blocks of N). The run modelled is
the widest one: every row decodes every token (no early stop), all rows in every round, a full window.

Peak = weights + cache + max over the round's calls of (what the round holds + the call), each term in bytes;
b = bytes per weight of the dtype, D = dim, kv = n_kv_heads x head_dim, H = mlp hidden, V = vocabulary,
n = depth; a call runs ``rows`` inputs of ``t`` tokens against ``c`` cached keys and reads logits at ``K``
positions per input (T = rows x t):

- weights: b x (V D embedding + V D output unless tied + n (D (D + 2kv) + D^2 + 3 D H + 2D) + D).
- cache (the exact block cache of a block-causal model only): B x L x 2kv x n x b, twice while ``KVCache.append``
  concatenates (every layer's new tensor is made before the old list goes), plus ``KVCache.select`` copying it
  for the call's inputs: rows x c x 2kv x n x b.
- held keys/values: a call that appends to a cache (the block cache's fills and the verification call that folds
  a finished block in) keeps every layer's keys and values until it returns, and each layer's v is a view of its
  whole qkv projection: T x (D + 3kv) x b x n; it grows with depth, as the cache does (``depth_bytes``). A call
  that appends nothing keeps none (``TransformerLM.layer_states(keep=False)``): 0.
- activations: the largest layer's transients, T x max((4D + 4H) b, (6D + 3kv + 2D g) b + 8D) (the MLP step holds
  the layer's input, the attention output, the residual, the normed input, the [T, 2H] projection, silu and the
  product; the attention step its q/k/v, the float32 rotary temporaries, the output, and with grouped-query
  heads (g = 1) k and v repeated to every head), or the attention mask while it is built if larger (two more
  copies), plus the mask itself (rows x t x (c + t) bool) and the rotary tables (T x head_dim x 4 x 2).
- logits: the call's logits at the head, rows x K x V x (b + 4): the model's dtype, then float32 for the rows
  read (``samplers/calling.py: settle``; b + 0 in float32, where the cast is a no-op).
- sampler buffers (float32 [rows, K, V] and [R, W + 1, V] tensors the round keeps): see ``_calls``.
- fef's ``call_tokens`` runs a call in parts of whole inputs with at most that many positions: the forward terms
  are one part's, plus the float32 logits of the parts before it.

``logit_positions`` gives K, the logit positions per input: it mirrors ``samplers/order.py: read_band`` with the
widths the steppers ask for (``SequentialStepper.logits``: 1; ``MarginalDrafts.band``: W + 1; ``StaleDrafts.band``:
2W + 2 ahead), or every position of a call that asks for all of them (the structured verifier's state), or none
(the block cache's fills, ``BlockCacheSession._fill``). ``tests/test_real_shape.py`` checks the prediction
against a peak measured in a subprocess within 15% (and that K is what the samplers ask the model for). Tensors
only: a CPU's BLAS adds a few MiB of scratch per large matrix product, which the measurement sees.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

from dllm.cli import UserError

GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODELLED = ("sequential", "fef")  # the samplers whose rounds are modelled here


@dataclass(frozen=True)
class Geometry:
    """The widest round of a run, in the numbers the terms need."""

    batch: int
    prompt: int
    new: int
    block: int  # the sampler's block length
    session: str  # "none" (whole-sequence calls) or "block" (the exact block cache)
    # (positions per input, cached keys) of the round's calls in each kind of block: the whole sequence; or, with
    # the block cache, the view (the active block, and the next with stale drafts' lookahead, none after the
    # last) plus the finished block a call folds in (``BlockCacheSession.logits``'s commit; none in block 0)
    widths: tuple[tuple[int, int], ...]
    positions: int  # K: logit positions per input
    vocab: int
    b: int  # bytes per weight


@dataclass
class _Call:
    """One model call of the round and what the round holds while it runs and after it returns."""

    name: str
    rows: int
    held: int  # bytes the round holds during the call
    after: int  # bytes the round holds just after it (its logits in float32 included)
    all_logits: bool = False  # the call asks for every position's logits (K = its tokens)
    no_logits: bool = False  # the call asks for none (K = 0: a cache fill)


@dataclass
class Plan:
    """The predicted peak and its parts at the peak moment (bytes)."""

    setting: dict
    weights: int
    cache: int  # block cache kept across rounds, its append copy and the call's select copy
    held_kv: int  # keys/values of every layer held during the call
    activations: int
    logits: int  # the call's logits at the head, and what the round holds of them
    peak: int
    depth_bytes: int  # the part of the peak that grows with depth
    phase: str  # the call (and moment) where the peak falls
    notes: list[str] = field(default_factory=list)

    def terms(self) -> dict[str, int]:
        return {"weights": self.weights, "cache": self.cache, "held_kv": self.held_kv,
                "activations": self.activations, "logits": self.logits}


def logit_positions(sampler: str, options: dict, block: int) -> int:
    """K: logits read per input in a round, as ``samplers/order.py: read_band`` gives them (left to right a band
    of the width the stepper asks for; any other order the active block, and the next one too for stale drafts).
    A band is never cut at the view's end (``Band.at`` repeats its last position)."""
    order = options.get("order", "left_to_right")
    stale = sampler == "fef" and options.get("draft") == "stale"
    if order == "left_to_right":
        return 1 if sampler == "sequential" else (2 * options["window"] + 2 if stale else options["window"] + 1)
    return 2 * block if stale else block


def weights_bytes(shape: dict, b: int) -> int:
    """Parameters x bytes (embedding, output unless tied, layers, final norm)."""
    d, h, v = shape["dim"], shape["mlp_hidden"], shape["vocab_size"]
    kv = _kv(shape)
    layer = d * (d + 2 * kv) + d * d + 3 * d * h + 2 * d + (d + 2 * kv if shape.get("qkv_bias") else 0)
    return b * (v * d * (1 if shape.get("tie_embeddings") else 2) + shape["n_layers"] * layer + d)


def _kv(shape: dict) -> int:
    return (shape.get("n_kv_heads") or shape["n_heads"]) * (shape["dim"] // shape["n_heads"])


def geometry(shape: dict, dtype: str, batch: int, prompt: int, new: int, sampler: str, options: dict) -> Geometry:
    """The widest round's numbers for these (validated, filled) options."""
    from dllm.samplers.sessions import choose_session

    block = options["block_length"]
    session = choose_session(options["cache"], _stub(shape), block)
    if session not in ("none", "block"):
        raise UserError(f"--option cache={options['cache']}: the planner models cache=auto, none and block (the "
                        "exact sessions); Fast-dLLM's approximate caches are not modelled")
    if session == "none":
        widths = ((prompt + new, 0),)
    else:
        blocks = new // block
        ahead = block if sampler == "fef" and options.get("draft") == "stale" else 0
        widths = {(block + (ahead if blocks > 1 else 0), prompt)}  # block 0: the prompt is cached
        if blocks > 2:  # the last block but one: its finished neighbour folded in, the next block ahead
            widths.add((2 * block + ahead, prompt + (blocks - 3) * block))
        if blocks > 1:  # the last block: no lookahead past the canvas
            widths.add((2 * block, prompt + (blocks - 2) * block))
        widths = tuple(sorted(widths))
    return Geometry(batch, prompt, new, block, session, widths, logit_positions(sampler, options, block),
                    shape["vocab_size"], _DTYPE_BYTES[dtype])


def _stub(shape: dict):
    """What the sampler registry and ``choose_session`` read of a model: a TransformerLM's declared record."""
    from dllm.protocols import Capabilities

    block = shape.get("block_size") if shape["layout"] == "block_causal" else None
    caps = Capabilities(accepts_attention_mask=True, block_size=block, cache=True,
                        cache_exact=shape["layout"] != "bidirectional", cache_crop=True, cache_drop=True,
                        commits_prefix=True, structured_verify=True, hidden_states=True, logits_at=True)
    vocab = shape["vocab_size"]
    return types.SimpleNamespace(capabilities=caps, vocab_size=vocab, mask_token_id=vocab - 1)


def _calls(sampler: str, o: dict, g: Geometry, temperature: float) -> list[_Call]:
    """The widest round's calls (their inputs) and the float32 buffers the round holds around each, as the code
    of ``samplers/sequential/`` and ``samplers/fef/`` keeps them (R = batch rows, all active).

    sequential: one state call; holds nothing between calls. fef (copies verifier): marginal drafts make a state
    call (copy 0, kept as the draft logits [R, K, V]), drafts are gathered and masked ([R, W, V] twice), then one
    call on the W copies (W + 1 with stale drafts, whose stored [B, K, V] and gathered [R, K, V] logits are held;
    a draft tree adds one copy per branch depth); after it the round holds the draft and copy logits, their
    concatenation (marginal), the next state's logits (stale), the target logits [R, W + 1, V] (gathered, then the
    mask forbidden: twice), their softmax and the drafts' at T > 0, and, in confidence order, the masked copy and
    exponentials of ``top1_probability`` over every input's band (twice its logits).
    """
    rows, k, v = g.batch, g.positions, g.vocab
    f32 = lambda n, width=k: n * width * v * 4  # noqa: E731
    confidence = o.get("order", "left_to_right") != "left_to_right"
    if sampler == "sequential":
        return [_Call("state", rows, 0, f32(rows) + (2 * f32(rows) if confidence else 0))]
    w = o["window"]
    window = 2 * f32(rows, w)  # the window's draft logits gathered, then the mask token forbidden (a clone)
    target = 2 * f32(rows, w + 1) + (f32(rows, w + 1) + f32(rows, w) if temperature > 0 else 0)
    stale = o["draft"] == "stale"
    extra = o["draft_candidates"] - 1  # siblings per depth: each brings one copy per later depth
    branches = extra * (w * (w + 1) // 2 if stale else w * (w - 1) // 2)
    copies = rows * (w + 1 if stale else w) + rows * branches
    tree = 3 * f32(rows * extra * w, w + 1) if extra else 0  # sibling paths, their targets and masked targets
    if o["verifier"] == "structured":  # one pass: targets at W + 1 queries and the state's logits at every position
        held = f32(rows) + window
        return [_Call("state", rows, 0, f32(rows) + window),
                _Call("structured", rows, held, held + f32(rows, w + 1) + f32(rows, max(g.widths)[0]) + target,
                      all_logits=True)]
    scores = 2 * f32(rows + copies) if confidence else 0  # top1_probability over the band: masked copy, exp
    if stale:
        stored = f32(g.batch)  # StaleDrafts.stale, kept across rounds
        held = stored + f32(rows) + window + tree
        return [_Call("copies", copies, held, held + f32(copies) + f32(rows) + target + scores)]
    held = f32(rows) + window + tree
    return [_Call("state", rows, 0, f32(rows) + (2 * f32(rows) if confidence else 0)),
            _Call("copies", copies, held, held + f32(copies) + f32(rows + copies) + target + scores)]


def _forward(shape: dict, g: Geometry, call: _Call, width: tuple[int, int], call_tokens: int | None = None
             ) -> dict[str, int]:
    """The call's own bytes at its peak: the cache's select copy, held keys/values, and the larger of the
    largest layer's transients and the logits at the head (module docstring). With ``call_tokens`` (fef's option)
    the session runs the call in parts of whole inputs holding at most that many positions (``_Session._split``):
    the terms are the last part's, plus the float32 logits of the parts before it. ``width``: (positions per
    input, cached keys)."""
    d, h, kv, b, layers = shape["dim"], shape["mlp_hidden"], _kv(shape), g.b, shape["n_layers"]
    tokens, context = width
    total = call.rows
    if call_tokens is not None and total * tokens > call_tokens:
        call = _Call(call.name, max(1, call_tokens // max(tokens, 1)), call.held, call.after, call.all_logits,
                     call.no_logits)
    positions = 0 if call.no_logits else tokens if call.all_logits else g.positions
    earlier = (total - call.rows) * positions * g.vocab * 4
    t = call.rows * tokens
    head_dim = d // shape["n_heads"]
    select = call.rows * context * 2 * kv * layers * b if g.session == "block" else 0
    held_kv = t * (d + 3 * kv) * b * layers if g.session == "block" else 0  # only calls that append keep them
    grouped = 2 * d if kv < d else 0  # grouped-query heads: k and v repeated to every query head
    mask = call.rows * tokens * (context + tokens)  # bool, alive through the layers; 3 while it is built
    layer = max(t * max((4 * d + 4 * h) * b, (6 * d + 3 * kv + grouped) * b + 8 * d), 2 * mask)
    masks = mask + t * head_dim * 8  # and the rotary tables
    head = call.rows * positions * g.vocab * (b + 4 if b != 4 else 4) + call.rows * positions * d * (b + 8)
    return {"select": select, "held_kv": held_kv, "activations": layer + masks, "head": head, "earlier": earlier}




def plan(shape: dict, dtype: str, batch: int, prompt_length: int, max_new_tokens: int, sampler: str,
         options: dict, temperature: float = 0.0, flag: str = "--option") -> Plan:
    """The predicted peak of ``sampler`` on a model of ``shape`` (a ``cost_model.ARCHS``-style dict with
    ``n_layers``; ``tie_embeddings`` / ``qkv_bias`` when known) for this batch and lengths; a bad option is
    refused naming ``flag``."""
    filled = _resolve(shape, sampler, options, max_new_tokens, flag)
    g = geometry(shape, dtype, batch, prompt_length, max_new_tokens, sampler, filled)
    weights = weights_bytes(shape, g.b)
    length = prompt_length + max_new_tokens
    layers, kv = shape["n_layers"], _kv(shape)
    cache = 2 * batch * length * 2 * kv * layers * g.b if g.session == "block" else 0
    best = None
    split = filled.get("call_tokens")  # fef's bound on one forward's positions (absent in older registries)
    calls = [(c, _forward(shape, g, c, width, split)) for c in _calls(sampler, filled, g, temperature)
             for width in g.widths]
    if g.session == "block" and prompt_length:  # the cache's first call: the prompt, no logits asked
        fill = _Call("prompt fill", batch, 0, 0, no_logits=True)
        calls.append((fill, _forward(shape, g, fill, (prompt_length, 0))))
    for call, f in calls:
        inside = f["earlier"] + max(f["activations"], f["head"])
        moments = {f"during the {call.name} call": (call.held + f["select"] + f["held_kv"] + inside, f),
                   f"after the {call.name} call": (call.after, None)}
        for phase, (total, parts) in moments.items():
            if best is None or total > best[0]:
                best = (total, phase, call, parts)
    total, phase, call, parts = best
    if parts is None:  # after the call: the round's logits only
        terms = {"cache": cache, "held_kv": 0, "activations": 0, "logits": total}
    else:
        act = parts["activations"] if parts["activations"] >= parts["head"] else 0
        terms = {"cache": cache + parts["select"], "held_kv": parts["held_kv"], "activations": act,
                 "logits": call.held + parts["earlier"] + (parts["head"] if not act else 0)}
    depth = terms["cache"] + terms["held_kv"]
    setting = {"shape": shape, "dtype": dtype, "batch": batch, "prompt_length": prompt_length,
               "max_new_tokens": max_new_tokens, "sampler": sampler, "temperature": temperature,
               "options": {k: v for k, v in filled.items() if _plain(v)}, "session": g.session,
               "logit_positions": g.positions, "call_widths": g.widths}
    return Plan(setting, weights, terms["cache"], terms["held_kv"], terms["activations"], terms["logits"],
                weights + sum(terms.values()), depth, phase, _notes(g, filled, sampler))


def _plain(value) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _resolve(shape: dict, sampler: str, options: dict, max_new_tokens: int, flag: str) -> dict:
    """Defaults filled and values checked by the sampler's own config (the registry), on a stand-in model."""
    from dllm.samplers import SAMPLERS

    if sampler not in MODELLED:
        raise UserError(f"--sampler must be one of {', '.join(MODELLED)} (the rounds eval/study/planner.py models), "
                        f"got {sampler!r}")
    if shape["layout"] == "causal":
        raise UserError("--model: a causal architecture; sequential and fef decode diffusion models")
    try:
        filled = SAMPLERS[sampler].resolve(dict(options), model=_stub(shape), max_new_tokens=max_new_tokens)
    except (TypeError, ValueError) as error:
        raise UserError(f"{flag}: {error}") from None
    if filled.get("draft") == "head":
        raise UserError(f"{flag} draft=head: the planner models draft=marginal and draft=stale")
    return filled


def _notes(g: Geometry, options: dict, sampler: str) -> list[str]:
    widest = max(w for w, _ in g.widths)
    out = [f"{'whole-sequence calls (no cache)' if g.session == 'none' else 'exact block cache'}: an input holds "
           f"up to {widest} positions; logits read at {g.positions} per input (logit_positions)"]
    if sampler == "fef" and options["draft_candidates"] > 1:
        out.append("draft tree: every sibling counted (an upper bound with candidates_below)")
    if options.get("call_tokens"):
        out.append(f"call_tokens={options['call_tokens']}: each forward holds at most that many positions (whole "
                   "inputs, at least one)")
    return out


# --------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------


def model_shape(model: str, layers: int | None = None) -> dict:
    """A preset's or a folder's shape, with ``tie_embeddings`` and ``qkv_bias`` where the config says them."""
    from dllm.eval.study.cost_model import arch_config

    try:
        shape = arch_config(model)
    except ValueError as error:
        raise UserError(f"--model {model}: {error}") from None
    config = Path(model) / "config.json"
    if config.is_file():
        hub = json.loads(config.read_text())
        shape["tie_embeddings"] = bool(hub.get("tie_embeddings", hub.get("weight_tying",
                                                                          hub.get("tie_word_embeddings", False))))
        shape["qkv_bias"] = bool(hub.get("qkv_bias", hub.get("include_qkv_bias", hub.get("model_type") == "Dream")))
    elif model.startswith("dream-7b"):
        shape["qkv_bias"] = True
    if layers is not None:
        shape["n_layers"] = layers
    return shape


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llada-8b", help="a preset (llada-8b, dream-7b, ARCH+blockN, ...) or a folder")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-length", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sampler", default="fef", help=f"one of {', '.join(MODELLED)}")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="sampler option (repeatable)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--layers", type=int, help="depth (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check_args(args) -> None:
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.prompt_length < 0:
        raise UserError(f"--prompt-length must be >= 0, got {args.prompt_length}")
    if args.layers is not None and args.layers < 1:
        raise UserError(f"--layers must be >= 1, got {args.layers}")
    if args.dtype not in _DTYPE_BYTES:
        raise UserError(f"--dtype must be one of {', '.join(_DTYPE_BYTES)}, got {args.dtype!r}")
    if args.sampler not in MODELLED:
        raise UserError(f"--sampler must be one of {', '.join(MODELLED)} (the rounds eval/study/planner.py models), "
                        f"got {args.sampler!r}")


_SHOWN = ("window", "draft", "order", "draft_candidates", "verifier", "block_length", "cache", "call_tokens")


def describe(result: Plan) -> str:
    s = result.setting
    shape = s["shape"]
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    options = ", ".join(f"{k}={v}" for k, v in sorted(s["options"].items()) if k in _SHOWN and v is not None)
    lines = [f"dllm plan: {shape['n_layers']} layers, dim {shape['dim']}, vocabulary {shape['vocab_size']}, "
             f"{s['dtype']}; batch {s['batch']}, prompt {s['prompt_length']} + {s['max_new_tokens']} new tokens; "
             f"{s['sampler']} ({options})",
             f"  weights            {gib(result.weights)}",
             f"  KV cache           {gib(result.cache)}   (the exact block cache; none for whole-sequence calls)",
             f"  held keys/values   {gib(result.held_kv)}   (every layer's, in a call that appends to a cache)",
             f"  activations        {gib(result.activations)}   (the largest layer's transients, masks)",
             f"  logits, sampler    {gib(result.logits)}   ({s['logit_positions']} logit positions per input)",
             f"  peak               {gib(result.peak)}   ({result.phase})"]
    return "\n".join(lines + [f"  note: {n}" for n in result.notes])


def main(argv: list[str] | None = None) -> int:
    """``dllm plan``: print the predicted peak memory of a run and its parts."""
    from dllm.samplers import parse_options

    args = parser().parse_args(argv)
    check_args(args)
    shape = model_shape(args.model, args.layers)
    options = parse_options(args.sampler, args.option)
    result = plan(shape, args.dtype, args.batch_size, args.prompt_length, args.max_new_tokens, args.sampler,
                  options, temperature=args.temperature)
    if args.json:
        print(json.dumps({"peak_bytes": result.peak, "peak_gib": result.peak / GIB, "terms_bytes": result.terms(),
                          "depth_bytes": result.depth_bytes, "phase": result.phase, "setting": result.setting,
                          "notes": result.notes}))
    else:
        print(describe(result))
    return 0


if __name__ == "__main__":
    from dllm.cli import run_guarded

    sys.exit(run_guarded("plan", main))
