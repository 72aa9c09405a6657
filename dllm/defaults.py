"""The defaults every entry point shares (Python, ``dllm generate/eval/bench``, lm-eval), written once.

The README's "Defaults" section explains each choice; change a value here and every entry point follows.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used, so `import dllm.cli` stays cheap (Ctrl-C at start-up)
    import torch

# Greedy, as LLaDA's and Dream's own generate and every evaluation harness default to; exact samplers
# reproduce the model's law at any temperature, so T > 0 is one flag away.
TEMPERATURE = 0.0
# fef: the fastest exact setting in tokens/s measured on the shipped model (README, "Measured performance":
# window 8 with marginal drafts, 555.5 tok/s; stale drafts carry more tokens per call but ran at 428.3).
FEF_WINDOW = 8
FEF_DRAFT = "marginal"
# fef draft="head" without draft_head=: the head trained for the shipped diffusion model (its README).
FEF_HEAD = str(Path(__file__).resolve().parent / "weights" / "fef_head")
# ... and the one trained for the shipped two-stream model (dllm/weights/two_stream), on its query features.
TWO_STREAM_HEAD = str(Path(__file__).resolve().parent / "weights" / "two_stream_head")


def default_draft_head(model) -> str:
    """The head ``draft="head"`` loads without ``draft_head=``: the two-stream one for a model declaring
    the reveal-order cache, else the block-diffusion one."""
    from dllm.protocols import capabilities

    return TWO_STREAM_HEAD if capabilities(model).reveal_order_cache else FEF_HEAD

class _MaxNew:
    """The default of an option that takes the value of ``max_new_tokens`` (one block, one step per token)."""

    def __repr__(self) -> str:
        return "max_new_tokens"


MAX_NEW = _MaxNew()

# Every sampler option's default, by sampler, and only here: the configs of samplers/ read them (a config that
# extends another inherits its table: fef extends sequential, ar_spec extends ar, every masked-diffusion sampler
# has "masked"). A model may declare settings measured fastest on it (Capabilities.sampler_defaults), which
# generate applies where the caller sets nothing; tests/test_configs.py holds the configs to this table.
SAMPLER_DEFAULTS: dict[str, dict[str, object]] = {
    "ar": {"cache": "auto"},
    "ar_spec": {"drafter": "ngram", "num_draft_tokens": 4, "max_ngram": 3, "draft_head": None,
                "draft_confidence": None, "draft_candidates": 1, "candidates_below": None, "draft_cutoff": None},
    "masked": {"block_length": MAX_NEW, "cache": "auto"},
    "llada": {"steps": MAX_NEW, "remasking": "low_confidence", "cfg_scale": 0.0},
    "dream": {"steps": MAX_NEW, "alg": "maskgit_plus", "alg_temp": None, "top_p": None, "top_k": None},
    "fast_dllm": {"threshold": None, "factor": None},
    "eb": {"gamma": 0.01},
    # LLaDA2's generate (the model class's method; 2.1's token editing when editing_threshold is given); its names
    # for generate's own parameters (eos_id, mask_id, gen_length) are checked against them, None: not given
    "llada2": {"steps": 32, "threshold": 0.95, "top_k": None, "top_p": None, "minimal_topk": 1,
               "editing_threshold": None, "max_post_steps": 16, "num_to_transfer": 1, "eos_early_stop": False,
               "eos_id": None, "mask_id": None, "gen_length": None},
    # SDAR's block_diffusion_generate (its generate.py command line's defaults); its names for generate's own
    # parameters (mask_id, gen_length, stopping_criteria_idx) are checked against them, None: not given
    "sdar": {"denoising_steps": 4, "remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 0.85,
             "top_k": 0, "top_p": 1.0, "eb_threshold": None, "mask_id": None, "gen_length": None,
             "stopping_criteria_idx": None},
    "sequential": {"order": "left_to_right"},
    "fef": {"window": FEF_WINDOW, "draft": FEF_DRAFT, "verifier": "copies", "draft_head": None,
            "draft_candidates": 1, "candidates_below": None, "call_tokens": None, "draft_cutoff": None,
            "compile": False},
    "native": {"generate_kwargs": None, "drafter": None},
}

# New tokens per call of generate, `dllm generate` and a server request without max_tokens: an answer of the
# shipped models (a GSM8K-style chain of thought is 20-50 of their tokens) in a few seconds on a CPU.
MAX_NEW_TOKENS = 64
# New tokens per answer in `dllm eval`: enough for a real model's GSM8K chain of thought. It caps this default at
# what the model's context leaves after the longest prompt (an explicit --max-new-tokens is checked strictly).
EVAL_MAX_NEW_TOKENS = 256
# Which distribution out.logprobs (and the server's logprobs) report: the law each token was sampled from, so
# that an exact sampler's logprobs sum to the log-probability of its sample (what RL's importance ratios and
# scoring need); "raw" is the model's distribution at temperature 1 (samplers/likelihood.py).
LOGPROBS_MODE = "sampled"
LOGPROBS_MODES = ("sampled", "raw")
DTYPE = "auto"  # see auto_dtype
DTYPES = ("auto", "float32", "bfloat16", "float16")

# dllm serve (its flags read these; a request's max_tokens defaults to MAX_NEW_TOKENS). A request without temperature
# samples at OpenAI's documented default, 1.0, which clients written against OpenAI expect (--default-temperature 0:
# greedy, as the other entry points).
SERVE_TEMPERATURE = 1.0
# Lanes decoding at once: the load study's top concurrency, where fef's throughput was 1.46x one lane's on a 2-core
# CPU, up from 1.35x at 4 (docs/measurements.md, "dllm serve under load").
SERVE_MAX_BATCH_SIZE = 16
# Lanes queued beyond those before a request gets 429: four full batches; a longer queue turns a quick 429 into a
# slow answer.
SERVE_MAX_QUEUE = 64
# Choices one request may ask (n): one full batch.
SERVE_MAX_N = 16
# Seconds requests in flight get to finish at SIGTERM / SIGINT: a default answer's p99 latency with 16 lanes was at
# most 3.7 s in the load study, and 10 s stays well inside Kubernetes' default 30 s termination grace period.
SERVE_GRACE_S = 10.0


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16)."""
    import torch

    cpu = getattr(torch, "cpu", None)
    probes = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    if any(callable(probe) for probe in probes):
        return any(callable(probe) and probe() for probe in probes)
    # Older torch: only the dispatch level is known; it names bf16 / AMX when the kernels use them.
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "BF16" in capability or "AMX" in capability


def auto_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """bf16 on a GPU that supports it or a CPU with native bf16; float32 elsewhere.

    Without native bf16 a CPU emulates it: the diffusion samplers then run 2-2.5x slower than in float32
    (measured on an AVX2 EPYC), which would skew any speed comparison.
    """
    import torch

    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device | None = None,
                  flag: str = "dtype") -> torch.dtype | None:
    """``"auto"`` -> auto_dtype(device); a dtype name -> the torch dtype; None stays None (checkpoint's)."""
    import torch

    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"{flag} must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)
