"""Forward latency of a target architecture on this device, and each sampler's projected speed on it.

    dllm bench --cost-model --arch llada-8b --arch qwen3-8b --output runs/cost      # latency curves only
    dllm bench --cost-model --results runs/bench/results.json --output runs/bench   # curves + projection

Measure: the project's TransformerLM with the target's shape and random weights (no download) is built at
a few depths (``--cost-layers``, default 1,2 on a CPU, where a full 8B model is far too slow), and one
forward is timed for every (rows, new tokens, cached context) of a grid. Per grid point, latency is fitted
as fixed + per_layer x depth (least squares over the measured depths; the fixed part is the embedding and
the output head, which do not grow with depth) and evaluated at the target's full depth.

Project: every configuration in a results.json carries the shapes of all its model calls (rows x copies,
new tokens, cached keys), recorded on the small shipped models. Replayed on the target's latency table:
projected time per token = sum over calls of latency(rows, tokens, context) / generated tokens. Model
names map to architectures with ``--role NAME=ARCH``, repeatable to project one model onto several targets
(default: ar -> qwen3-8b, diffusion -> llada-8b and llada-8b+block8, drafter -> qwen3-0.6b).
``ASSUMPTIONS`` lists what this leaves out; it is written next to the numbers.

Layouts. Call shapes are only valid on a target whose attention allows the same computation
(``needs`` / ``fits``). The shipped diffusion model is block-causal: its exact block cache (and ar_spec's
block drafter) call only the active block against cached earlier blocks. LLaDA-8B and Dream-7B attend
bidirectionally, so there every exact step is a whole-sequence call: such a configuration is reported as
not valid on them, never replayed. It is projected on a block-causal target with the same block size:
``ARCH+blockN`` turns any preset into one (e.g. ``llada-8b+block8``, a hypothetical LLaDA-8B trained for
block diffusion; block-diffusion models converted from AR ones, like ``qwen3-8b+block4``, have this shape).
Whole-sequence configurations (no cache, or Fast-dLLM's approximate caches) are valid on both.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dllm.cli import UserError
from dllm.models.loading import detect_kind
from dllm.models.native import dream_config, llada_config
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import is_causal_model
from dllm.samplers.sessions import choose_session

# Target shapes (dims from the models' published configs). head_dim is dim / n_heads in TransformerLM.
ARCHS: dict[str, dict[str, Any]] = {
    "llada-8b": dict(dim=4096, n_layers=32, n_heads=32, vocab_size=126464, mlp_hidden=12288, layout="bidirectional"),
    "dream-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, mlp_hidden=18944,
                     layout="bidirectional"),
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, vocab_size=151936, mlp_hidden=12288,
                     layout="causal"),
    "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, vocab_size=151936, mlp_hidden=3072,
                       layout="causal"),
    "tiny": dict(dim=64, n_layers=2, n_heads=2, vocab_size=256, mlp_hidden=128, layout="causal"),  # for tests
    "tiny-bidirectional": dict(dim=64, n_layers=2, n_heads=2, vocab_size=256, mlp_hidden=128, layout="bidirectional"),
}
# Not rows yet (eval/study/real_shape.py and eval/study/planner.py read this table too): LLaDA2-mini is a mixture of
# experts (256 experts, 8 active, one dense first layer, half-width rotary; shared/remote_code/llada2), which these
# dense fields cannot state; SDAR's published config here (SDAR-4B: 32 heads of 128 over hidden 2560) has n_heads x
# head_dim != dim, which TransformerLM derives as dim / n_heads, and SDAR-1.7B's config is not among the fixtures to
# copy its dims from. Both need a head_dim field (and experts for LLaDA2) before a row is honest.
DEFAULT_ROLES = {"ar": ("qwen3-8b",), "diffusion": ("llada-8b", "llada-8b+block8"), "drafter": ("qwen3-0.6b",)}
BLOCK_SUFFIX = "+block"  # ARCH+blockN: the preset with block-causal attention in blocks of N
GRIDS = {  # (rows, new tokens, cached context, depths measured, repetitions)
    "cpu": ((1, 4), (1, 16), (0, 64), (1, 2), 2),
    "cuda": ((1, 4, 16, 64), (1, 8, 32, 128), (0, 256, 1024), (2, 4), 5),
}
ASSUMPTIONS = (
    "random weights: a forward's latency does not depend on the weight values",
    "depth: measured at {layers} layers; latency = fixed (embedding, final norm, output head) + per_layer x "
    "n_layers, fitted per grid point and evaluated at the target's depth (one measured depth: scaled in "
    "proportion to depth, which overcounts the head)",
    "the project's TransformerLM (RMSNorm, rotary, SwiGLU, SDPA attention, grouped-query heads) stands in for "
    "the target; head_dim = dim / n_heads (Qwen3's 128-wide heads are narrower here where dim / n_heads < 128); "
    "no fused kernels beyond SDPA, no quantisation",
    "{dtype} on {device}",
    "projection replays call shapes and acceptance measured on the small shipped models (results.json): an 8B "
    "model accepts differently, so read it as 'an 8B target that accepted like the small one'",
    "layouts: a configuration is replayed only on targets whose attention makes its recorded calls the same "
    "computation (block-cached calls of the block-causal study model need a block-causal target with its block "
    "size; LLaDA-8B and Dream-7B are bidirectional); the grid of valid pairs is written with the numbers",
    "only model forwards count: sampling, verification, cache gathers and Python overhead are left out (small "
    "next to an 8B forward on a GPU, not on a CPU)",
    "shapes outside the grid: proportional to rows and to new tokens beyond the largest measured (compute "
    "bound), linear in cached context beyond the largest; each run reports the share of its projected time "
    "that came from such extrapolation",
)


def add_arguments(group) -> None:
    """The cost-model flags of ``dllm bench`` (shared parser: --device, --dtype, --output also apply)."""
    group.add_argument("--cost-model", action="store_true", help="measure forward latency; project a results.json")
    group.add_argument("--arch", action="append", default=[],
                       help=f"architecture to measure: {', '.join(ARCHS)} or a model folder (repeatable)")
    group.add_argument("--results", help="results.json of a study to project onto the architectures")
    group.add_argument("--role", action="append", default=[], metavar="MODEL=ARCH",
                       help="architecture standing in for a study model, repeatable for several targets (default "
                            "ar=qwen3-8b, diffusion=llada-8b and diffusion=llada-8b+block8, drafter=qwen3-0.6b)")
    for name in ("rows", "tokens", "contexts", "layers"):
        group.add_argument(f"--cost-{name}", help=f"comma-separated {name} of the grid (default depends on "
                                                   "device; --cost-layers full: measure at full depth)")
    group.add_argument("--cost-reps", type=int, help="timed calls per grid point (median)")


# --------------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    layers: tuple[int, ...]  # depths to measure; () = the architecture's full depth
    reps: int


def arch_config(arch: str) -> dict[str, Any]:
    """TransformerConfig fields of a preset (``+blockN``: made block-causal), or of a folder's config.json."""
    if arch in ARCHS:
        return dict(ARCHS[arch])
    file = Path(arch) / "config.json"
    if BLOCK_SUFFIX in arch and not file.is_file():
        base, _, size = arch.rpartition(BLOCK_SUFFIX)
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"architecture {arch!r}: {BLOCK_SUFFIX}N needs a block size N >= 1, got {size!r}")
        return {**arch_config(base), "layout": "block_causal", "block_size": int(size)}
    if not file.is_file():
        raise ValueError(f"architecture {arch!r} is neither a preset ({', '.join(ARCHS)}, or one with "
                         f"{BLOCK_SUFFIX}N) nor a folder with config.json")
    config = json.loads(file.read_text())
    kind = detect_kind(config)  # dllm.load's reading of the folder, so both see the same architecture
    if kind == "dllm":
        keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "mlp_hidden", "layout", "block_size")
        return {k: config[k] for k in keys if config.get(k) is not None}
    if kind in _NATIVE:  # the native loader's own mapping (its defaults, mlp_ratio, vocab padding, layout)
        try:
            native = _NATIVE[kind](config, 0, None, None)  # token ids do not shape the calls
        except ValueError as error:  # a variant the native model does not implement: no shape to trust
            raise ValueError(f"architecture {arch!r}: {error}") from None
        return {k: getattr(native, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                 "mlp_hidden", "layout")}
    if kind not in (None, "causal", "mlm"):
        raise ValueError(f"architecture {arch!r}: the cost model has no shape for kind {kind!r} checkpoints")
    missing = [k for k in _HF_KEYS if k not in config]
    if missing:
        raise ValueError(f"architecture {arch!r}: config.json lacks {missing} (transformers' names)")
    return dict(dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
                n_heads=config["num_attention_heads"], n_kv_heads=config.get("num_key_value_heads"),
                vocab_size=config["vocab_size"], mlp_hidden=config["intermediate_size"],
                layout="bidirectional" if kind == "mlm" else "causal")


_NATIVE = {"llada": llada_config, "dream": dream_config}
_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def needs(model, role: str, options: dict[str, Any]) -> str:
    """What a configuration's recorded calls of ``model`` assume of a target's attention (read by ``fits``).

    "causal" (AR calls), "diffusion" (whole-sequence calls or approximate caches: any diffusion layout), or
    "block_causal:N" (calls of the active block only: the exact block cache, or ar_spec's block drafter,
    which reads the canvas only up to its drafts' block).
    """
    if is_causal_model(model):
        return "causal"
    size = getattr(model, "block_size", None)
    if role == "draft":
        return f"block_causal:{size}" if size else "diffusion"
    if choose_session(options.get("cache", "none"), model, options.get("block_length")) == "block":
        return f"block_causal:{size}"
    return "diffusion"


def _needs_of_old_results(run: dict) -> dict[str, str | None]:
    """``needs`` for a results.json written before it was recorded: read off the sampler and call shapes."""
    from dllm.samplers import SAMPLERS

    if SAMPLERS[run["sampler"]].model_kind == "causal":
        return {"target": "causal", "draft": None}  # a drafter's layout was not recorded: unchecked
    cache = run["options"].get("cache", "none")
    cached = any(c["context"] for c in run["call_shapes"] if c["role"] == "target")
    block = cache == "block" or (cache == "auto" and cached)
    return {"target": f"block_causal:{run['options'].get('block_length')}" if block else "diffusion", "draft": None}


def fits(need: str | None, arch: str, shape: dict[str, Any]) -> str | None:
    """Why calls that ``need`` a layout cannot be replayed on ``arch`` (None: they can)."""
    layout = shape["layout"]
    if need is None:
        return None
    if need == "causal":
        return None if layout == "causal" else f"AR calls need a causal target; {arch} is {layout}"
    if layout == "causal":
        return f"diffusion calls need a bidirectional or block-causal target; {arch} is causal"
    if need.startswith("block_causal:"):
        size = need.partition(":")[2]
        if layout != "block_causal" or str(shape.get("block_size")) != size:
            has = layout if layout != "block_causal" else f"block-causal in blocks of {shape.get('block_size')}"
            base = arch.rpartition(BLOCK_SUFFIX)[0] or arch
            return (f"its calls cover one block against cached earlier blocks (exact only with block-causal "
                    f"attention in blocks of {size}); {arch} is {has}: project onto e.g. {base}{BLOCK_SUFFIX}{size}")
    return None


def build(shape: dict[str, Any], n_layers: int, max_len: int, device, dtype) -> TransformerLM:
    """A randomly initialised TransformerLM of ``shape`` at ``n_layers`` depth, built directly in ``dtype``."""
    fields = {**shape, "n_layers": n_layers, "max_seq_len": max_len}
    if fields["layout"] != "causal":
        fields["mask_token_id"] = fields["vocab_size"] - 1
    with building(device, dtype):
        return TransformerLM(TransformerConfig(**fields)).eval()


@contextlib.contextmanager
def building(device, dtype):
    """Modules made inside are built on ``device`` in ``dtype`` directly (no float32 copy of a
    billion-parameter embedding on the way)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _time(fn, reps: int, device) -> float:
    """Median seconds of ``reps`` calls after one warm-up call, device synchronised around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure_depth(model: TransformerLM, grid: Grid, device) -> dict[tuple[int, int, int], float]:
    """Seconds of one forward for every (rows, new tokens, cached context) of the grid."""
    vocab = model.vocab_size - 1  # leave the mask id out of the inputs
    out = {}
    for rows in grid.rows:
        for context in grid.contexts:
            cache = _prefilled_cache(model, rows, context, vocab, device) if context else None
            for tokens in grid.tokens:
                x = torch.randint(vocab, (rows, tokens), device=device)
                call = functools.partial(model, x) if cache is None else \
                    functools.partial(model.forward_cached, x, cache, append=False)
                out[(rows, tokens, context)] = _time(call, grid.reps, device)
    return out


def _prefilled_cache(model: TransformerLM, rows: int, context: int, vocab: int, device, chunk: int = 256):
    """A KV cache of ``context`` random tokens per row, filled in chunks (whole-context logits would not fit)."""
    cache = model.new_cache()
    for start in range(0, context, chunk):
        width = min(chunk, context - start)
        model(torch.randint(vocab, (rows, width), device=device), cache=cache, use_cache=True)
    return cache


def _fit(depths: tuple[int, ...], seconds: list[float], target: int) -> tuple[float, bool]:
    """Latency at ``target`` depth from (depth, seconds) points -> (seconds, slope clamped at 0)."""
    if len(depths) == 1:
        return seconds[0] * target / depths[0], False
    mean_d, mean_s = statistics.fmean(depths), statistics.fmean(seconds)
    slope = sum((d - mean_d) * (s - mean_s) for d, s in zip(depths, seconds)) / sum((d - mean_d) ** 2 for d in depths)
    clamped = slope < 0  # noise larger than a layer's cost
    slope = max(slope, 0.0)
    return mean_s + slope * (target - mean_d), clamped


@dataclass
class LatencyTable:
    """Full-depth forward latency of one architecture over a (rows, tokens, context) grid."""

    arch: str
    shape: dict[str, Any]
    grid: Grid
    seconds: dict[tuple[int, int, int], float]
    measured: dict[int, dict[tuple[int, int, int], float]]
    clamped: int = 0

    def latency(self, rows: int, tokens: int, context: int) -> tuple[float, bool]:
        """Interpolated seconds of one call (piecewise linear per axis) -> (seconds, extrapolated)."""
        def by_context(r, t):
            return _interp(self.grid.contexts, context, lambda c: (self.seconds[(r, t, c)], False), proportional=False)

        def by_tokens(r):
            return _interp(self.grid.tokens, tokens, lambda t: by_context(r, t), proportional=True)

        return _interp(self.grid.rows, rows, by_tokens, proportional=True)

    def to_dict(self) -> dict:
        points = [{"rows": r, "tokens": t, "context": c, "seconds": s,
                   "measured": {str(d): self.measured[d][(r, t, c)] for d in self.measured}}
                  for (r, t, c), s in sorted(self.seconds.items())]
        return {"shape": self.shape, "n_layers": self.shape["n_layers"], "layers_measured": list(self.measured),
                "slope_clamped_points": self.clamped, "points": points}


def _interp(axis: tuple[int, ...], x: float, value_at, proportional: bool) -> tuple[float, bool]:
    """Piecewise-linear interpolation over ``axis`` of ``value_at(point) -> (value, extrapolated)``.

    Past the last point: proportional to x (rows, tokens: compute bound), or the last segment's slope
    (context: attention is linear in it). Below the first point: the first value.
    """
    if x <= axis[0]:
        value, extra = value_at(axis[0])
        return value, extra or x < axis[0]
    if x >= axis[-1]:
        last, extra = value_at(axis[-1])
        if x == axis[-1]:
            return last, extra
        if proportional or len(axis) == 1:
            return last * (x / axis[-1] if proportional else 1.0), True
        before, _ = value_at(axis[-2])
        return last + max(last - before, 0.0) / (axis[-1] - axis[-2]) * (x - axis[-1]), True
    i = bisect.bisect_right(axis, x) - 1
    (low, extra_low), (high, extra_high) = value_at(axis[i]), value_at(axis[i + 1])
    t = (x - axis[i]) / (axis[i + 1] - axis[i])
    return (1 - t) * low + t * high, extra_low or extra_high


def measure(arch: str, grid: Grid, device, dtype, progress=print) -> LatencyTable:
    """Time the grid at each measured depth and fit the full-depth latency table."""
    shape = arch_config(arch)
    max_len = max(grid.contexts) + max(grid.tokens) + 1
    depths = grid.layers or (shape["n_layers"],)
    measured = {}
    for depth in depths:
        model = build(shape, depth, max_len, device, dtype)
        measured[depth] = measure_depth(model, grid, device)
        del model
        progress(f"  {arch}: {depth} layer(s) measured")
    seconds, clamped = {}, 0
    for point in measured[depths[0]]:
        seconds[point], was_clamped = _fit(depths, [measured[d][point] for d in depths], shape["n_layers"])
        clamped += was_clamped
    return LatencyTable(arch, shape, grid, seconds, measured, clamped)


# --------------------------------------------------------------------------------------------------------
# Projecting
# --------------------------------------------------------------------------------------------------------


def project(results: dict, tables: dict[str, LatencyTable], roles: dict[str, tuple[str, ...]]) -> list[dict]:
    """Projected time per token of every configuration in ``results`` on each of its model's target archs.

    One row per (configuration, target). A target whose attention cannot run the recorded calls (``fits``)
    gets ``valid`` False, its reason in ``why`` and no projected numbers. The drafter runs on the first of its
    role's archs that fits its calls.
    """
    rows = []
    for run in results["runs"]:
        if not run["call_shapes"]:  # sampler="native": the checkpoint's own loop records no call shapes
            continue
        need = run.get("needs") or _needs_of_old_results(run)
        drafters = _role(roles, run["drafter"]) if run.get("drafter") else (None,)
        drafter, why_not_drafter = _first_fit(need["draft"], drafters, tables)
        for target in _role(roles, run["model"]):
            why = fits(need["target"], target, tables[target].shape) or why_not_drafter
            row = {"name": run["name"], "sampler": run["sampler"], "target_arch": target, "drafter_arch": drafter,
                   "valid": why is None, "why": why, "measured_speedup": run.get("speedup"), "exact": run.get("exact"),
                   "projected_s_per_token": None, "projected_tokens_per_s": None, "extrapolated_fraction": None}
            if why is None:
                row.update(_replay(run, tables[target], tables.get(drafter)))
            rows.append(row)
    valid = [r for r in rows if r["valid"]]
    if not valid:
        raise ValueError("no configuration in these results has recorded call shapes valid on its targets: "
                         + "; ".join(f"{r['name']} on {r['target_arch']}: {r['why']}" for r in rows[:3]))
    base = next((r for r in valid if r["name"] == results.get("baseline")), valid[0])
    for row in rows:
        row["projected_speedup"] = base["projected_s_per_token"] / row["projected_s_per_token"] if row["valid"] \
            else None
    return rows


def _first_fit(need: str | None, archs: tuple, tables: dict[str, LatencyTable]) -> tuple[str | None, str | None]:
    """The first arch that runs calls needing ``need`` -> (arch, None), or (None, why none does)."""
    if archs == (None,):
        return None, None
    reasons = [fits(need, arch, tables[arch].shape) for arch in archs]
    if None in reasons:
        return archs[reasons.index(None)], None
    return None, f"drafter: {reasons[0]}"


def _replay(run: dict, target: LatencyTable, drafter: LatencyTable | None) -> dict:
    """The run's recorded calls replayed on the latency tables -> projected seconds per token and extrapolation."""
    total = extrapolated = 0.0
    for call in run["call_shapes"]:
        table = target if call["role"] == "target" else drafter
        seconds, extra = table.latency(call["rows"], call["tokens"], call["context"])
        total += seconds * call["count"]
        extrapolated += seconds * call["count"] * extra
    per_token = total / max(run["new_tokens"], 1)
    return {"projected_s_per_token": per_token, "projected_tokens_per_s": 1 / per_token if per_token else 0.0,
            "extrapolated_fraction": extrapolated / total if total else 0.0}


def _role(roles: dict[str, tuple[str, ...]], name: str) -> tuple[str, ...]:
    if name not in roles:
        raise ValueError(f"model {name!r} of the results has no architecture; pass --role {name}=ARCH "
                         f"(one of {', '.join(ARCHS)}, ARCH{BLOCK_SUFFIX}N, or a model folder)")
    return roles[name]


def parse_roles(items: list[str]) -> dict[str, tuple[str, ...]]:
    """``--role MODEL=ARCH`` items over DEFAULT_ROLES; a model named more than once gets each arch, in order."""
    if any("=" not in item for item in items):
        raise UserError(f"--role expects MODEL=ARCH, got {items}")
    given: dict[str, tuple[str, ...]] = {}
    for model, arch in (item.split("=", 1) for item in items):
        given[model] = given.get(model, ()) + ((arch,) if arch not in given.get(model, ()) else ())
    return {**DEFAULT_ROLES, **given}


# --------------------------------------------------------------------------------------------------------
# Reports and the command
# --------------------------------------------------------------------------------------------------------


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    values = default if text is None else tuple(int(v) for v in text.split(","))
    if not values or min(values) < 0 or list(values) != sorted(set(values)):
        raise ValueError(f"grid values must be increasing non-negative ints, got {text!r}")
    return values


def grid_from_args(args, device) -> Grid:
    rows, tokens, contexts, layers, reps = GRIDS["cuda" if device.type == "cuda" else "cpu"]
    contexts = _ints(args.cost_contexts, contexts)
    layers = () if args.cost_layers == "full" else _ints(args.cost_layers, layers)
    grid = Grid(_ints(args.cost_rows, rows), _ints(args.cost_tokens, tokens), contexts if 0 in contexts else
                (0, *contexts), layers, args.cost_reps or reps)
    if min(grid.rows) < 1 or min(grid.tokens) < 1 or min(grid.layers, default=1) < 1 or grid.reps < 1:
        raise ValueError("grid rows, tokens, layers and reps must be >= 1")
    return grid


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when matplotlib is missing."""
    from dllm.extras import missing

    try:
        import matplotlib
    except ImportError:
        print(f"dllm bench: no plots: {missing('matplotlib', 'bench', 'plotting')}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown(report: dict) -> str:
    lines = ["# Cost model", "", "Assumptions:", ""] + [f"- {a}" for a in report["assumptions"]] + [""]
    lines += ["| arch | rows | tokens | context | ms (full depth) |", "| --- | --- | --- | --- | --- |"]
    for arch, table in report["archs"].items():
        lines += [f"| {arch} | {p['rows']} | {p['tokens']} | {p['context']} | {p['seconds'] * 1e3:.2f} |"
                  for p in table["points"]]
    if report["projection"]:
        lines += _projection_markdown(report["projection"])
    return "\n".join(lines) + "\n"


def _projection_markdown(proj: dict) -> list[str]:
    """Which configuration is valid on which target (a grid), then the projected numbers of the valid pairs."""
    targets = list(dict.fromkeys(r["target_arch"] for r in proj["runs"]))
    valid = {(r["name"], r["target_arch"]): r["valid"] for r in proj["runs"]}
    names = list(dict.fromkeys(r["name"] for r in proj["runs"]))
    lines = ["", f"Projection of {proj['results']} (roles {proj['roles']}), speedups vs `{proj['baseline']}`.", "",
             "Valid configurations per target (yes: its recorded calls run the same computation there; no: see "
             "below; -: not a target of its model):", "",
             "| configuration | " + " | ".join(targets) + " |", "|" + " --- |" * (len(targets) + 1)]
    lines += [f"| {name} | " + " | ".join({True: "yes", False: "no", None: "-"}[valid.get((name, t))]
                                          for t in targets) + " |" for name in names]
    lines += ["", "| configuration | target | drafter | proj. ms/token | proj. speedup | measured speedup | "
              "extrapolated |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in proj["runs"]:
        if r["valid"]:
            measured = "-" if r["measured_speedup"] is None else f"{r['measured_speedup']:.2f}"
            lines.append(f"| {r['name']} | {r['target_arch']} | {r['drafter_arch'] or '-'} | "
                         f"{r['projected_s_per_token'] * 1e3:.2f} | {r['projected_speedup']:.2f} | {measured} | "
                         f"{r['extrapolated_fraction']:.0%} |")
    invalid = [r for r in proj["runs"] if not r["valid"]]
    if invalid:
        lines += ["", "Not projected (the recorded calls would not be the same computation on the target):", ""]
        lines += [f"- {r['name']} on {r['target_arch']}: {r['why']}" for r in invalid]
    return lines


def plot(report: dict, folder: Path) -> list[str]:
    """latency.png (per arch, over rows x tokens) and, with a projection, projection.png."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arch, table in report["archs"].items():
        for context in sorted({p["context"] for p in table["points"]}):
            points = sorted((p["rows"] * p["tokens"], p["seconds"]) for p in table["points"] if p["context"] == context)
            ax.plot(*zip(*points), "o-" if context == 0 else "s--", label=f"{arch}, context {context}")
    ax.set(xscale="log", yscale="log", xlabel="query tokens per call (rows x new tokens)",
           ylabel="seconds per forward (full depth)", title=f"Forward latency on {report['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=120)
    plt.close(fig)
    if not report["projection"]:
        return ["latency.png"]
    runs = [r for r in report["projection"]["runs"] if r["valid"]]  # invalid pairs have no projection
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(runs) + 1.5))
    y = range(len(runs))
    ax.barh([i - 0.2 for i in y], [r["projected_speedup"] for r in runs], height=0.4, label="projected (target)")
    ax.barh([i + 0.2 for i in y], [r["measured_speedup"] or 0 for r in runs], height=0.4, label="measured (study)")
    ax.set_yticks(list(y), [f"{r['name']} \u2192 {r['target_arch']}" for r in runs], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"speedup vs {report['projection']['baseline']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "projection.png", dpi=120)
    plt.close(fig)
    return ["latency.png", "projection.png"]


def main(args) -> int:
    """``dllm bench --cost-model``: measure, project (with --results), write cost_model.json/.md and plots."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device in (None, "auto")
                          else args.device)
    dtype_name = args.dtype or "bfloat16"
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = grid_from_args(args, device)
    results = json.loads(Path(args.results).read_text()) if args.results else None
    roles = parse_roles(args.role)
    archs = list(args.arch)
    if results is not None:  # every architecture the projection needs, plus any asked for
        needed = {a for r in results["runs"] for a in _role(roles, r["model"])}
        needed |= {a for r in results["runs"] if r.get("drafter") for a in _role(roles, r["drafter"])}
        archs += sorted(needed - set(archs))
    archs = archs or ["llada-8b", "qwen3-8b"]
    print(f"cost model on {device} ({dtype_name}): {', '.join(archs)}; grid {grid}")
    tables = {arch: measure(arch, grid, device, getattr(torch, dtype_name)) for arch in archs}
    layers = ",".join(map(str, grid.layers)) or "full depth (no scaling)"
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu, {torch.get_num_threads()} thread(s)",
        "dtype": dtype_name, "torch_version": torch.__version__,
        "assumptions": [a.format(layers=layers, dtype=dtype_name, device=device) for a in ASSUMPTIONS],
        "grid": {"rows": grid.rows, "tokens": grid.tokens, "contexts": grid.contexts, "layers": grid.layers,
                 "reps": grid.reps},
        "archs": {arch: table.to_dict() for arch, table in tables.items()},
        "projection": None if results is None else {
            "results": str(args.results), "roles": roles, "baseline": results.get("baseline"),
            "runs": project(results, tables, roles)},
    }
    folder = Path(args.output or "runs/bench")
    folder.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot(report, folder)
    (folder / "cost_model.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (folder / "cost_model.md").write_text(text)
    print(text[text.index("Projection"):] if report["projection"] else text)  # the latency grid is long
    print(f"wrote {folder / 'cost_model.json'}, cost_model.md and {len(report['plots'])} plots")
    return 0
