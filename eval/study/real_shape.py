"""The real-shape study: a random-weight model at a published shape, a few layers deep, loaded by ``dllm.load``
from a hub-layout folder; per sampler and batch size, peak memory above the weights, time per round, the
sampler's share of a round, synchronisations per round, and a projection to the full depth.

    dllm study real-shape --arch llada-8b --layers 2 --dtype bfloat16 --batch-sizes 1,8 \\
        --samplers sequential,fef:window=8 --prompt-length 30 --max-new-tokens 256 --output runs/real_shape
    dllm study real-shape --arch dream-7b --samplers fef:window=8,draft_candidates=2 --max-new-tokens 64

``--samplers`` lists samplers separated by commas, each optionally followed by ``:KEY=VALUE,KEY=VALUE`` (a
comma-separated piece holding ``=`` belongs to the sampler before it). Shapes are ``cost_model.ARCHS`` rows
(the published dims); ``FAMILIES`` says which hub layout writes each (the families ``dllm.load`` reads natively).

Folder: config.json with the hub's field names, random bf16 (or ``--dtype``) weights saved as safetensors
shards with their index, no tokenizer (the config names the mask and stop ids); written once per (arch,
layers, dtype) under ``--cache-dir`` and reused. Each (sampler, batch) then runs in a subprocess of its own, so
its peak is its own: it loads the folder with ``dllm.load``, runs one small forward (the libraries' first-call
buffers stay out of the peak), records its baseline, runs ``dllm.generate`` on a random prompt (T = 0 unless
``--temperature``, no stop ids, so every row decodes ``--max-new-tokens``) and reports:

- memory: CPU: resident size after loading (VmRSS) as the baseline, the high-water mark (VmHWM, reset through
  ``/proc/self/clear_refs`` at the baseline) above it; glibc's mmap threshold is fixed at 64 KiB in the child
  (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set at once and the mark reads live bytes,
  as ``torch.cuda.max_memory_allocated`` does. CUDA (written, not run here): ``max_memory_allocated`` above
  ``memory_allocated`` at the baseline. On a CPU the child's address space is capped near the free memory
  (``--memory-limit``), so a run that does not fit fails its allocation and reports "out of memory" instead of
  calling the machine's OOM killer; a child killed anyway is reported too, never crashing the study.
- time per round: a round is a model call of the target (``DecodeStats.nfe``); also per generated token.
- the sampler's share of a round: wall time of ``generate`` less the model's forward time (its top-level
  ``forward`` / ``forward_cached`` / ``structured_verify`` calls, wrapped; CUDA events on a GPU), over the wall.
- synchronisations per round: ``dllm.syncs.count_syncs`` over the first ``--sync-calls`` model calls of a second,
  untimed decode (counting slows a decode several times; without CUDA it counts what would synchronise on a GPU);
  n/a where ``dllm.syncs`` is missing.
- projection to full depth: time per round = sampler + fixed part (embedding, head, masks: forward less its
  layers, timed by hooks on each layer) + per-layer time x full depth / measured depth; peak memory = the
  weights at full depth + the measured peak above the weights + what grows with depth between the two depths,
  from ``eval/study/planner.py`` (keys/values held per layer, a block cache).

Each run stops at ``--time-limit`` seconds of decoding (reported as "time limit", with the numbers so far: a
round's cost and peak are those of the first rounds). ``--compile``: each layer's attention and MLP under
``torch.compile`` (dynamic shapes), compiled during the warm-up. ``results.json`` and ``results.md`` go to
``--output``, with the planner's prediction beside each measured peak (``row_rounds`` there is
``DecodeStats.rounds``, rounds summed over rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dllm.cli import UserError
from dllm.eval.study import planner
from dllm.eval.study.cost_model import ARCHS

FAMILIES = {"llada-8b": "llada", "dream-7b": "dream"}  # presets with a hub layout dllm.load reads natively
GIB = 2**30
_LOAD_ALLOWANCE_S = 900  # a child's load and warm-up on top of --time-limit, before the parent gives up on it
_MMAP_THRESHOLD = 65536  # bytes: glibc serves larger allocations with their own mappings (returned when freed)

# The hub's config.json per family (LLaDA-8B-Instruct's and Dream-v0-Instruct-7B's keys and token ids); the
# sizes come from ARCHS. Keys the native loader checks (dllm/models/native.py) keep their real values.
_HUB = {
    "llada": dict(architectures=["LLaDAModelLM"], model_type="llada", activation_type="silu", alibi=False,
                  block_type="llama", block_group_size=1, include_bias=False, include_qkv_bias=False,
                  layer_norm_type="rms", layer_norm_with_affine=True, bias_for_layer_norm=False,
                  attention_layer_norm=False, input_emb_norm=False, scale_logits=False, multi_query_attention=None,
                  rope=True, rope_theta=500000.0, rms_norm_eps=1e-5, max_sequence_length=4096, weight_tying=False,
                  mask_token_id=126336, eos_token_id=126081, pad_token_id=126081),
    "dream": dict(architectures=["DreamModel"], model_type="Dream", hidden_act="silu", rope_scaling=None,
                  use_sliding_window=False, sliding_window=None, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, tie_word_embeddings=False, mask_token_id=151666,
                  bos_token_id=151643, eos_token_id=151643, pad_token_id=151643),
}
_LAYER_PREFIX = {"llada": "model.transformer.blocks.", "dream": "model.layers."}  # as native.py's families read


@dataclass(frozen=True)
class Run:
    """One (sampler, batch) measurement, as handed to its subprocess."""

    folder: str
    sampler: str
    options: list[str]  # KEY=VALUE, parsed in the child by the sampler's option kinds
    batch: int
    prompt_length: int
    max_new_tokens: int
    temperature: float
    device: str
    dtype: str
    time_limit: float
    threads: int | None = None
    compile: bool = False
    memory_limit_gib: float | None = None  # None: free memory at the child's start less a margin (CPU only)
    sync_calls: int = 8  # model calls of the untimed pass that counts synchronisations (0: none)
    seed: int = 0


# --------------------------------------------------------------------------------------------------------
# The hub-layout folder
# --------------------------------------------------------------------------------------------------------


def hub_config(family: str, shape: dict, n_layers: int) -> dict:
    """config.json of a ``family`` checkpoint with ``shape``'s sizes (the hub's field names)."""
    base = dict(_HUB[family])
    if family == "llada":
        sizes = dict(d_model=shape["dim"], n_layers=n_layers, n_heads=shape["n_heads"],
                     n_kv_heads=shape.get("n_kv_heads") or shape["n_heads"], mlp_hidden_size=shape["mlp_hidden"],
                     vocab_size=shape["vocab_size"], embedding_size=shape["vocab_size"])
    else:
        sizes = dict(hidden_size=shape["dim"], num_hidden_layers=n_layers, num_attention_heads=shape["n_heads"],
                     num_key_value_heads=shape.get("n_kv_heads") or shape["n_heads"],
                     intermediate_size=shape["mlp_hidden"], vocab_size=shape["vocab_size"])
    if base["mask_token_id"] >= shape["vocab_size"]:  # a small test vocabulary: its last id is the mask
        base.update(mask_token_id=shape["vocab_size"] - 1, eos_token_id=0, pad_token_id=0)
        base.update({"bos_token_id": 0} if "bos_token_id" in base else {})
    return {**base, **sizes}


def hub_tensors(family: str, shape: dict, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the hub checkpoint, name -> shape, from native.py's weight-name tables."""
    from dllm.models.native import DREAM_LAYER, DREAM_TOP, LLADA_LAYER, LLADA_TOP

    layer, top = (LLADA_LAYER, LLADA_TOP) if family == "llada" else (DREAM_LAYER, DREAM_TOP)
    dim, hidden, vocab = shape["dim"], shape["mlp_hidden"], shape["vocab_size"]
    kv = (shape.get("n_kv_heads") or shape["n_heads"]) * (dim // shape["n_heads"])
    ours = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,), "output.weight": (vocab, dim)}
    out = {hub: ours[name] for hub, name in top.items()}
    biases = family == "dream"  # Dream's q/k/v carry biases, LLaDA's do not (include_qkv_bias false)
    for i in range(n_layers):
        for hub, (name, slot) in layer.items():
            if name.endswith("bias") and not biases:
                continue
            rows = {"q": dim, "k": kv, "v": kv, "gate": hidden, "up": hidden}.get(slot, dim)
            cols = hidden if name == "mlp.w2.weight" else dim
            out[f"{_LAYER_PREFIX[family]}{i}.{hub}"] = (rows,) if name.endswith(("bias", "norm.weight")) else \
                (rows, cols)
    return out


def write_folder(folder: Path, family: str, shape: dict, n_layers: int, dtype: str, seed: int = 0,
                 shard_bytes: int = 2 * GIB) -> Path:
    """A hub-layout checkpoint of random weights (normal, std 0.02; norms 1, biases 0) in ``dtype`` shards."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = hub_tensors(family, shape, n_layers)
    size = getattr(torch, dtype).itemsize
    shards: list[list[str]] = [[]]
    used = 0
    for name, dims in tensors.items():
        nbytes = size * _numel(dims)
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: _random(name, tensors[name], getattr(torch, dtype), generator) for name in names},
                  str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = size * sum(_numel(d) for d in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {**hub_config(family, shape, n_layers), "torch_dtype": dtype}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _numel(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _random(name: str, dims: tuple[int, ...], dtype, generator):
    import torch

    if name.endswith("bias"):
        return torch.zeros(dims, dtype=dtype)
    if len(dims) == 1:  # norms
        return torch.ones(dims, dtype=dtype)
    return (torch.randn(dims, generator=generator, dtype=torch.float32) * 0.02).to(dtype)


def ensure_folder(cache_dir: Path, arch: str, shape: dict, n_layers: int, dtype: str, progress=print) -> Path:
    """The cached folder of (arch, layers, dtype), written first when missing or unfinished."""
    folder = cache_dir / f"{arch}-{n_layers}L-{dtype}"
    stamp = folder / "real_shape.json"
    wanted = {"arch": arch, "shape": shape, "n_layers": n_layers, "dtype": dtype, "family": FAMILIES.get(arch, "llada")}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return folder
    progress(f"writing {arch} at {n_layers} layer(s), {dtype}, random weights, to {folder}")
    started = time.perf_counter()
    write_folder(folder, wanted["family"], shape, n_layers, dtype)
    stamp.write_text(json.dumps(wanted))  # last: a folder without it is rewritten
    progress(f"  written in {time.perf_counter() - started:.0f}s")
    return folder


# --------------------------------------------------------------------------------------------------------
# One run, in its own process
# --------------------------------------------------------------------------------------------------------


class _TimeUp(Exception):
    """--time-limit reached: the run stops at its next model call."""


class _Clock:
    """Counts and times the model's top-level calls and, inside them, its layers.

    The instance's ``forward``, ``forward_cached`` and ``structured_verify`` are wrapped (the inner call of
    ``forward_cached`` to ``forward`` counts once); each layer gets pre/post hooks. On CUDA the spans are
    events read after the run, so timing adds no synchronisation.
    """

    def __init__(self, model, deadline: float, cuda: bool):
        self.model, self.deadline, self.cuda = model, deadline, cuda
        self.calls, self.depth, self.budget = 0, 0, None  # budget: calls allowed before _TimeUp
        self.spans: list = []  # (start, end) perf_counter seconds, or CUDA events
        self.layer_spans: list = []
        self._open: list = []
        for name in ("forward", "forward_cached", "structured_verify"):
            if callable(getattr(model, name, None)):
                setattr(model, name, self._wrap(getattr(model, name)))
        self.hooks = []
        for layer in getattr(model, "layers", ()):
            self.hooks.append(layer.register_forward_pre_hook(lambda *_: self._open.append(self._mark())))
            self.hooks.append(layer.register_forward_hook(
                lambda *_: self.layer_spans.append((self._open.pop(), self._mark()))))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _wrap(self, method):
        def timed(*args, **kwargs):
            if self.depth:
                return method(*args, **kwargs)
            if time.perf_counter() > self.deadline or self.calls == self.budget:
                raise _TimeUp
            self.calls += 1
            self.depth, start = 1, self._mark()
            try:
                return method(*args, **kwargs)
            finally:
                self.spans.append((start, self._mark()))
                self.depth = 0

        return timed

    def seconds(self) -> tuple[float, float]:
        """(forward seconds, of which in layers), read once after the run."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            total = lambda spans: sum(a.elapsed_time(b) for a, b in spans) / 1e3  # noqa: E731
        else:
            total = lambda spans: sum(b - a for a, b in spans)  # noqa: E731
        return total(self.spans), total(self.layer_spans)


class _Memory:
    """Peak memory above a baseline: VmHWM above VmRSS on a CPU (the mark reset at the baseline), the
    allocator's peak above its allocated bytes on CUDA."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.base = _status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
            self.method = "VmHWM above VmRSS at the baseline (mark reset)"
        except OSError:
            self.method = "VmHWM above VmRSS at the baseline (mark not reset: includes loading)"

    def peak_above(self) -> int:
        """Bytes of the peak above the baseline."""
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated() - self.base
        return (_status_kib("VmHWM") - self.base) * 1024


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def _cap_address_space(limit_gib: float | None) -> float | None:
    """Cap this process's address space so an allocation past free memory fails here (reported as out of
    memory) instead of waking the machine's OOM killer -> the cap in GiB above the current size, or None."""
    if limit_gib is None:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        limit_gib = int(meminfo["MemAvailable"].split()[0]) / 2**20 - 1.0
    try:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = _status_kib("VmSize") * 1024 + int(limit_gib * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (OSError, ValueError):
        return None
    return round(limit_gib, 2)


def _count_syncs():
    """``dllm.syncs.count_syncs`` (a context manager whose ``SyncCount`` has ``count`` and ``by_op``; on a machine
    without CUDA it counts what would synchronise on a GPU), or None where that module is missing: n/a."""
    try:
        from dllm.syncs import count_syncs
    except ImportError:
        return None
    return count_syncs


def _is_out_of_memory(error: BaseException) -> bool:
    import torch

    text = str(error).lower()
    return isinstance(error, MemoryError | torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))


def _load(run: Run, device):
    """The folder's model (``--compile``: each layer's attention and MLP compiled, the layer hooks around them
    stay eager), warmed up, and a random prompt [B, P] without the mask id -> (model, prompt, load seconds)."""
    import torch

    import dllm

    started = time.perf_counter()
    model = dllm.load(run.folder, device=device, dtype=getattr(torch, run.dtype)).eval()
    load_s = time.perf_counter() - started
    if run.compile:
        for layer in model.layers:
            layer.attn.compile(dynamic=True)
            layer.mlp.compile(dynamic=True)
    generator = torch.Generator(device).manual_seed(run.seed)
    prompt = torch.randint(0, model.vocab_size - 1, (run.batch, run.prompt_length), generator=generator, device=device)
    prompt = prompt + (prompt >= model.mask_token_id).long()
    with torch.inference_mode():  # first-call buffers (and --compile's graphs) stay out of the peak and the time
        model(prompt[:1, :8].expand(2, -1))  # 2 rows: a compiled graph made here is not specialised to one row
    return model, prompt, load_s


def measure(run: Run) -> dict:
    """Load, warm up, decode once and measure (see the module docstring) -> the row's numbers."""
    import torch

    import dllm
    from dllm.samplers import parse_options

    if run.threads:
        torch.set_num_threads(run.threads)
    device = torch.device(run.device)
    model, prompt, load_s = _load(run, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = _Memory(device)
    cap = None if memory.cuda else _cap_address_space(run.memory_limit_gib)
    clock = _Clock(model, time.perf_counter() + 1e9, memory.cuda)
    tokens = torch.zeros((), dtype=torch.long, device=device)

    def count(event) -> None:  # on the device: no read per round
        tokens.add_((event.revealed >= 0).sum() if event.revealed.dtype != torch.bool else event.revealed.sum())

    options = parse_options(run.sampler, run.options)

    def decode(callback=None):
        return dllm.generate(model, prompt, sampler=run.sampler, max_new_tokens=run.max_new_tokens,
                             temperature=run.temperature, generator=torch.Generator(device).manual_seed(run.seed),
                             eos_token_id=None, callback=callback, **options)

    memory.start()
    clock.deadline = time.perf_counter() + run.time_limit
    status, stats = "ok", None
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            stats = decode(count).stats
    except _TimeUp:
        status = "time limit"
    except Exception as error:
        if not _is_out_of_memory(error):
            raise
        status = "out of memory"
    wall = time.perf_counter() - start
    forward_s, layers_s = clock.seconds()
    peak = memory.peak_above()
    calls = stats.nfe if stats is not None else clock.calls
    syncs = _sync_pass(decode, clock, run.sync_calls) if status != "out of memory" else None
    return {"status": status, "weights_bytes": weights, "peak_above_weights_bytes": peak,
            "memory_method": "torch.cuda.max_memory_allocated above memory_allocated" if memory.cuda
            else memory.method, "address_space_cap_gib": cap, "load_s": round(load_s, 1), "calls": calls,
            "new_tokens": stats.new_tokens if stats is not None else int(tokens),
            "row_rounds": stats.rounds if stats is not None else None, "wall_s": wall, "forward_s": forward_s,
            "layers_s": layers_s, "n_layers": len(model.layers), **(syncs or {"syncs": None}),
            "device": torch.cuda.get_device_name(device) if memory.cuda else
            f"cpu, {torch.get_num_threads()} thread(s)", "torch": torch.__version__}


def _sync_pass(decode, clock: _Clock, budget: int) -> dict | None:
    """Synchronising ops of the first ``budget`` model calls, counted in a second, untimed decode (counting
    slows a decode several times) -> {"syncs", "sync_calls", "syncs_by_op"}, or None without ``dllm.syncs``."""
    import torch

    count_syncs = _count_syncs()
    if count_syncs is None or budget < 1:
        return None
    clock.calls, clock.budget, clock.deadline = 0, budget, float("inf")
    with torch.inference_mode(), count_syncs() as counted, contextlib.suppress(_TimeUp):
        decode()
    return {"syncs": counted.count, "sync_calls": clock.calls, "syncs_by_op": dict(counted.by_op.most_common(8))}


def run_child(run: Run, timeout: float) -> dict:
    """``measure`` in a subprocess -> its numbers, or a status saying how it ended (killed, timed out, failed)."""
    env = dict(os.environ)
    if not run.device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = str(_MMAP_THRESHOLD)
    command = [sys.executable, "-m", "dllm.eval.study.real_shape", "--child", json.dumps(asdict(run))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"killed after {timeout:.0f}s (load + --time-limit)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    if done.returncode in (-9, 137):  # SIGKILL: the kernel's OOM killer, most likely
        return {"status": "out of memory (killed)"}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"failed (exit {done.returncode}): {last}"}


# --------------------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (sampler, batch) line of the report."""

    sampler: str
    batch: int
    measured: dict
    plan: dict
    projected: dict = field(default_factory=dict)


def parse_samplers(text: str) -> list[tuple[str, list[str]]]:
    """``"sequential,fef:window=8,draft_candidates=2"`` -> [("sequential", []), ("fef", ["window=8", ...])]."""
    from dllm.samplers import SAMPLERS

    out: list[tuple[str, list[str]]] = []
    for piece in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in piece and ":" not in piece:
            if not out:
                raise UserError(f"--samplers: option {piece!r} comes before any sampler name")
            out[-1][1].append(piece)
            continue
        name, _, first = piece.partition(":")
        if name not in SAMPLERS or SAMPLERS[name].model_kind != "diffusion":
            allowed = sorted(n for n, s in SAMPLERS.items() if s.model_kind == "diffusion")
            raise UserError(f"--samplers: {name!r} is not a diffusion sampler; allowed: {', '.join(allowed)}")
        out.append((name, [first] if first else []))
    if not out:
        raise UserError("--samplers needs at least one sampler, e.g. sequential,fef:window=8")
    return out


def label(sampler: str, options: list[str]) -> str:
    return sampler + (":" + ",".join(options) if options else "")


def project(row: Row, shape: dict, measured_layers: int) -> dict:
    """Time per round and per token, and peak memory, at the architecture's full depth (module docstring)."""
    m = row.measured
    if not m.get("calls") or "wall_s" not in m or m["status"] == "out of memory":
        return {}
    full = shape["n_layers"]
    scale = full / measured_layers
    sampler_s = max(m["wall_s"] - m["forward_s"], 0.0)
    fixed_s = max(m["forward_s"] - m["layers_s"], 0.0)
    total = sampler_s + fixed_s + m["layers_s"] * scale
    out = {"n_layers": full, "s_per_round": total / m["calls"],
           "s_per_token": total / m["new_tokens"] if m["new_tokens"] else None,
           "sampler_share": sampler_s / total if total else None}
    if m.get("peak_above_weights_bytes") is not None and row.plan:
        grows = row.plan["full"]["depth_bytes"] - row.plan["measured"]["depth_bytes"]
        out["peak_bytes"] = row.plan["full"]["weights_bytes"] + m["peak_above_weights_bytes"] + grows
    return out


def summarise(row: Row, measured_layers: int) -> dict:
    """The report's numbers of one row (rates from the measured counters)."""
    m = row.measured
    out = {"sampler": row.sampler, "batch": row.batch, "status": m["status"]}
    if "wall_s" not in m:
        return {**out, "planned_peak_above_weights_gib": row.plan["measured"]["above_weights_bytes"] / GIB}
    calls, tokens = m["calls"], m["new_tokens"]
    planned = row.plan["measured"]["above_weights_bytes"]
    measured = m["peak_above_weights_bytes"]
    out.update({
        "weights_gib": m["weights_bytes"] / GIB, "peak_above_weights_gib": measured / GIB,
        "planned_peak_above_weights_gib": planned / GIB,
        "planned_over_measured": planned / measured if measured > 0 else None,
        "calls": calls, "new_tokens": tokens, "row_rounds": m["row_rounds"], "wall_s": m["wall_s"],
        "s_per_round": m["wall_s"] / calls if calls else None, "s_per_token": m["wall_s"] / tokens if tokens else None,
        "sampler_share": (m["wall_s"] - m["forward_s"]) / m["wall_s"] if m["wall_s"] else None,
        "syncs_per_round": m["syncs"] / m["sync_calls"] if m.get("syncs") is not None and m["sync_calls"] else None,
        "syncs_by_op": m.get("syncs_by_op"),
        "layers_measured": measured_layers, "projected": row.projected})
    return out


def markdown(report: dict) -> str:
    s = report["setting"]
    lines = [f"# Real-shape study: {s['arch']} at {s['layers']} of {s['full_layers']} layers, {s['dtype']}", "",
             f"Random weights loaded by `dllm.load` from a hub-layout folder; prompt {s['prompt_length']} tokens, "
             f"{s['max_new_tokens']} new tokens, T={s['temperature']}, on {report.get('device', '?')}. A round is "
             "one model call of the target. Peak: above the loaded weights (planned: `dllm plan`, same setting).", "",
             f"Command: `{report['command']}`", "",
             "| sampler | batch | status | peak above weights (GiB) | planned | s / round | s / token | sampler share "
             "| syncs / round | full depth: s / round | s / token | peak (GiB) |",
             "|" + " --- |" * 12]
    for r in report["rows"]:
        p = r.get("projected") or {}
        cells = [r["sampler"], r["batch"], r["status"], _num(r.get("peak_above_weights_gib")),
                 _num(r.get("planned_peak_above_weights_gib")), _num(r.get("s_per_round"), 3),
                 _num(r.get("s_per_token"), 3), _pct(r.get("sampler_share")), _num(r.get("syncs_per_round"), 1),
                 _num(p.get("s_per_round"), 3), _num(p.get("s_per_token"), 3),
                 _num(p["peak_bytes"] / GIB if p.get("peak_bytes") is not None else None)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "syncs / round: `dllm.syncs.count_syncs` over the first model calls of a second, untimed decode "
              "(without CUDA: what would synchronise on a GPU). Full depth: time = sampler + fixed part + per-layer "
              "time scaled by depth; peak = weights at full depth + measured peak above weights + the planner's "
              "per-layer growth (held keys/values, block cache)."]
    return "\n".join(lines) + "\n"


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def study(args, progress=print, shape: dict | None = None) -> dict:
    """Every (sampler, batch) of ``args``, each in its own subprocess -> the report (also written to --output).
    ``shape``: instead of ``ARCHS[args.arch]`` (a small test shape, written in LLaDA's layout)."""
    shape = dict(ARCHS[args.arch] if shape is None else shape)
    planned = [(sampler, options, batch, plan_row(shape, args, sampler, options, batch))  # options checked first
               for sampler, options in args.samplers for batch in args.batch_sizes]
    folder = ensure_folder(Path(args.cache_dir).expanduser(), args.arch, shape, args.layers, args.dtype, progress)
    rows, device = [], args.device
    for sampler, options, batch, plan in planned:
        run = Run(str(folder), sampler, options, batch, args.prompt_length, args.max_new_tokens, args.temperature,
                  args.device, args.dtype, args.time_limit, args.threads, args.compile, args.memory_limit,
                  args.sync_calls)
        row = Row(label(sampler, options), batch, {}, plan)
        progress(f"== {row.sampler}, batch {batch}")
        row.measured = run_child(run, args.time_limit + _LOAD_ALLOWANCE_S)
        device = row.measured.get("device", device)
        row.projected = project(row, shape, args.layers)
        rows.append(summarise(row, args.layers))
        progress("   " + _line(rows[-1]))
    report = {"setting": {"arch": args.arch, "layers": args.layers, "full_layers": shape["n_layers"],
                          "dtype": args.dtype, "prompt_length": args.prompt_length,
                          "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                          "time_limit_s": args.time_limit, "compile": args.compile},
              "command": args.command, "device": device, "shape": shape, "folder": str(folder), "rows": rows}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (output / "results.md").write_text(markdown(report))
    return report


def plan_row(shape: dict, args, sampler: str, options: list[str], batch: int) -> dict:
    """The planner at the measured depth and at full depth (validates the options too)."""
    from dllm.samplers import parse_options

    typed = parse_options(sampler, options, flag="--samplers")
    out = {}
    for key, layers in (("measured", args.layers), ("full", shape["n_layers"])):
        plan = planner.plan({**shape, "n_layers": layers}, args.dtype, batch, args.prompt_length,
                            args.max_new_tokens, sampler, typed, temperature=args.temperature, flag="--samplers")
        out[key] = {"weights_bytes": plan.weights, "above_weights_bytes": plan.peak - plan.weights,
                    "depth_bytes": plan.depth_bytes, "terms": plan.terms(), "phase": plan.phase}
    return out


def _line(row: dict) -> str:
    if "wall_s" not in row:
        return f"{row['status']} (planned {row['planned_peak_above_weights_gib']:.2f} GiB above the weights)"
    return (f"{row['status']}: peak {row['peak_above_weights_gib']:.2f} GiB above the weights (planned "
            f"{row['planned_peak_above_weights_gib']:.2f}), {row['calls']} rounds, {_num(row['s_per_round'], 3)} "
            f"s/round, sampler {_pct(row['sampler_share'])}")


# --------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm study real-shape", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llada-8b", help=f"one of {', '.join(FAMILIES)}")
    p.add_argument("--layers", type=int, default=2, help="depth of the random model (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default 1,8)")
    p.add_argument("--samplers", default="sequential,fef:window=8",
                   help="comma-separated, each with :KEY=VALUE,... options (default sequential,fef:window=8)")
    p.add_argument("--prompt-length", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds of decoding per run (default 600)")
    p.add_argument("--memory-limit", type=float, help="GiB a CPU run may allocate above its loaded model (default: "
                                                      "the free memory at its start less 1 GiB)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available), cpu or cuda")
    p.add_argument("--threads", type=int, help="torch threads per run")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer's attention and MLP")
    p.add_argument("--sync-calls", type=int, default=8, help="model calls of the untimed second decode that counts "
                                                              "synchronisations (dllm.syncs; 0: skip it)")
    p.add_argument("--cache-dir", default="~/.cache/dllm/real_shape", help="where the random checkpoints are kept")
    p.add_argument("--output", default="runs/real_shape")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def check_args(args) -> None:
    """Refuse bad flags before anything is written or loaded (one line naming the flag)."""
    from dllm.cli import check_device

    if args.arch not in FAMILIES:
        raise UserError(f"--arch must be one of {', '.join(FAMILIES)} (the presets with a hub layout), got "
                        f"{args.arch!r}")
    try:
        args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes expects comma-separated ints, got {args.batch_sizes!r}") from None
    for flag, values in (("--batch-sizes", args.batch_sizes), ("--layers", [args.layers]),
                         ("--max-new-tokens", [args.max_new_tokens]), ("--prompt-length", [args.prompt_length])):
        if min(values) < 1:
            raise UserError(f"{flag} must be >= 1, got {values if len(values) > 1 else values[0]}")
    if args.layers > ARCHS[args.arch]["n_layers"]:
        raise UserError(f"--layers {args.layers}: {args.arch} has {ARCHS[args.arch]['n_layers']} layers")
    if args.dtype not in ("bfloat16", "float16", "float32"):
        raise UserError(f"--dtype must be bfloat16, float16 or float32, got {args.dtype!r}")
    if args.time_limit <= 0:
        raise UserError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    if args.sync_calls < 0:
        raise UserError(f"--sync-calls must be >= 0, got {args.sync_calls}")
    check_device(args.device)
    args.samplers = parse_samplers(args.samplers)


def main(argv: list[str] | None = None) -> int:
    """``dllm study real-shape ...`` (also ``python -m dllm.eval.study.real_shape ...``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        if argv[0] != "real-shape":
            raise UserError(f"the studies are: real-shape; got {argv[0]!r}")
        argv = argv[1:]
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(measure(Run(**json.loads(args.child)))))
        return 0
    args.command = "dllm study real-shape " + " ".join(argv)
    check_args(args)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    report = study(args)
    print(markdown(report))
    print(f"wrote {Path(args.output) / 'results.json'} and results.md")
    return 0


if __name__ == "__main__":
    from dllm.cli import run_guarded

    sys.exit(run_guarded("study", main))
