"""The two model protocols every sampler is written against: tokens in, logits out.

Samplers see nothing else. Faster paths (a KV cache, a model-specific window verifier) are optional
capabilities, declared in one ``Capabilities`` record per model (``capabilities(model)``), and must give
the same answer as the plain call.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DiffusionModel(Protocol):
    """A masked-diffusion denoiser: ``logits[:, i]`` scores the clean token at position i.

    Only masked positions are read. Logits may hold ``-inf`` (the mask token's own logit, say).
    """

    mask_token_id: int
    vocab_size: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        ...


@runtime_checkable
class CausalModel(Protocol):
    """An autoregressive LM: ``logits[:, i]`` scores the token at position i + 1."""

    vocab_size: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        ...


def is_diffusion_model(model: object) -> bool:
    """True when ``model`` declares a mask token, i.e. follows the DiffusionModel protocol."""
    return callable(model) and getattr(model, "mask_token_id", None) is not None and hasattr(model, "vocab_size")


def is_causal_model(model: object) -> bool:
    """True for a callable with a vocabulary and no mask token (the CausalModel protocol)."""
    return callable(model) and hasattr(model, "vocab_size") and not is_diffusion_model(model)


# ---------------------------------------------------------------------------------------------------------
# Optional capabilities: one frozen ``Capabilities`` record per model, read by samplers through
# ``capabilities(model)`` (never by getattr on the model). An adapter declares its record as a
# ``capabilities`` property; a bare logits function gets the record derived once, here, from the attributes
# documented below (so user models written against them keep working). Each capability must give the
# same answer as the plain call (up to floating point) unless it says it is approximate.
#
# attention_mask (ragged prompts): a model with ``accepts_attention_mask`` is called as
#   ``model(input_ids, attention_mask=mask)`` with mask [N, L] of 0/1 (0 = left padding). It derives
#   position ids from the mask (0 at each row's first real token). Without it, padded batches are refused;
#   ``padding_note`` (a phrase) may say why.
#
# context_length (the positions a model can read): an int bounding the longest row's real tokens
#   (padding excluded, since positions come from the mask) plus max_new_tokens, less one for a causal model,
#   which never reads the last token it samples. ``generate`` refuses longer requests before decoding (see
#   ``max_prompt_length``); None means no limit is checked.
#
# block_size (block-causal diffusion models): a model with an int ``block_size`` attends bidirectionally
#   inside blocks and causally across them; samplers call it with ``block_offset=`` a LongTensor [N],
#   the answer's first position per row in position-id coordinates, so model blocks line up with the
#   sampler's blocks (which start at the answer). The sampler's block_length must equal the run's block size
#   (``run_block_size``) for the exact block cache. ``block_logits_only``: the model gives logits only inside
#   its active block, so a sampler's blocks must nest inside the model's.
#   ``block_anchor`` says where the model's blocks were anchored in training: "answer" (the default; the
#   project's block-causal models, trained with blocks starting at the answer) or "absolute" (blocks start at
#   each row's first real token, position id 0, so the prompt is block-causal too and the answer's first block
#   may begin inside the prompt's last one: SDAR, TraDo, LLaDA2). For "absolute" a sampler passes
#   ``block_offset`` 0 (zeros [N]), lets the first answer block end at the next multiple of the run's block size
#   (the prompt's tail shares that model block), caches only whole model blocks (the prompt's tail is re-read
#   with the first block until that block is finished) and fills the last block out with masks to a multiple of
#   the run's block size (the model's own generation always sees whole blocks).
#   ``run_blocks``: the block size is a run's choice, not the checkpoint's: the model takes ``block_size=`` (an
#   int) in ``__call__``, ``forward_cached`` and ``structured_verify`` and builds its block-causal mask from it
#   (its own ``block_size`` is then only the default), as the family's official decoder builds its mask from its
#   own ``block_length`` (SDAR's ``block_diffusion_generate``, LLaDA2's ``generate``). A run's attention blocks
#   are ``run_block_size(model, block_length)``: the sampler's block_length on such a model, else block_size;
#   the sessions pass it on every call (``samplers/calling.py: Caller``), so a run never changes the model.
#
# KV cache (``cache``): ``model.new_cache()`` returns a cache with ``.length`` (int), ``.crop(length: int)``
#   (in place) and ``.select(rows: LongTensor) -> cache``. ``model.forward_cached(input_ids [N, n], cache, *,
#   rows=None, append=True, attention_mask=None, block_offset=None) -> logits [N, n, V]`` runs the new
#   tokens against the cached prefix (positions continue after it). With ``append`` the cache grows by
#   the new tokens (rows must be None); otherwise ``rows`` [N] names the cache row serving each input
#   (several copies may share one row) and the cache is left unchanged. ``attention_mask`` [N, length + n]
#   covers cached plus new keys. ``cache_exact`` says whether cached logits equal uncached ones: True for
#   causal models, and for block-causal models while the cache holds only whole blocks before the inputs'
#   block; False for bidirectional models (a Fast-dLLM-style approximation, opt-in). ``cache_crop``: its
#   caches have ``crop`` (the prefix cache); ``cache_drop``: they have ``drop(start, end)`` and
#   ``forward_cached`` takes ``position_ids=`` (the dual cache). A cache object whose ``croppable`` is False
#   cannot roll back rejected drafts (a property of the cache, which may depend on its layers).
#   ``commits_prefix``: ``forward_cached(..., rows=, commit=n)`` also appends the first n shared tokens.
#
# structured_verify: ``model.structured_verify(x, positions, drafts, count, bonus, ...)`` scores a fef
#   window in one pass (see dllm/models/transformer.py); fef's ``verifier='structured'`` needs it.
#
# native_loop: ``model.native_loop(prompt, max_new_tokens, *, temperature, attention_mask, ...)`` returns a
#   ``dllm.counting.NativeLoop`` (the call to run and the modules to count); samplers/baselines/native.py
#   runs the checkpoint's own sampler (``sampler='native'``).
#
# reveal_order_cache / one_pass_exact: the two-stream layout (dllm/models/two_stream.py): ``new_cache(B)``
#   and ``streams(content, positions, valid, query_pos, query_sees, cache=, rows=, append=)``; sequential and
#   fef then run samplers/fef/two_stream.py, whose one-pass window verification is the chain itself.
#
# logits_at (logits only where they are read): ``model(input_ids, ..., logits_at=at)`` and
#   ``forward_cached(..., logits_at=at)`` with ``at`` a LongTensor [N, K] of input positions return logits
#   [N, K, V] at those positions only, in the model's dtype (with ``return_hidden``, the features there too):
#   the output layer runs on gathered features. At a real vocabulary (126k-157k) the [N, L, V] float32 tensor of
#   every position is most of a round's memory, and samplers read a few positions. Sessions ask every model
#   this way; for a model without it they gather from the full answer (``gather_positions``), in one place.
#
# needs_prompt: the model cannot decode after an empty prompt (an encoder that reads the prompt, say);
#   ``generate`` refuses empty prompts for it. Every other model decodes from an empty prompt with every
#   sampler and cache mode.
# ---------------------------------------------------------------------------------------------------------


BLOCK_ANCHORS = ("answer", "absolute")  # where a block-causal model's blocks start (Capabilities.block_anchor)


@dataclass(frozen=True)
class Capabilities:
    """What a model offers beyond ``model(input_ids) -> logits``; the defaults are a bare logits function's."""

    accepts_attention_mask: bool = False
    padding_note: str | None = None  # why padding cannot be honoured, when accepts_attention_mask is False
    context_length: int | None = None
    block_size: int | None = None
    block_anchor: str = "answer"  # where blocks start, one of BLOCK_ANCHORS (see the block_size notes above)
    block_logits_only: bool = False
    run_blocks: bool = False  # block_size= per call: a run's blocks are its block_length (see the notes above)
    needs_prompt: bool = False
    cache: bool = False  # new_cache() and forward_cached()
    cache_exact: bool = False
    cache_crop: bool = False
    cache_drop: bool = False
    commits_prefix: bool = False
    structured_verify: bool = False
    native_loop: bool = False  # native_loop(): the checkpoint's own loop
    hidden_states: bool = False  # forward(..., return_hidden=True) -> (logits, features [B, L, D]) (draft heads)
    # forward_cached(..., position_ids=, tree_mask=[N, n, n] bool): a causal model verifies a draft tree in one call
    tree_attention: bool = False
    reveal_order_cache: bool = False  # streams(): revealed tokens cached in reveal order (dllm/models/two_stream.py)
    one_pass_exact: bool = False  # one call's window conditionals are the sequential chain's (fef exact in one pass)
    logits_at: bool = False  # __call__/forward_cached(..., logits_at=[N, K]) -> logits [N, K, V] in the model's dtype
    # forward_cached(..., rows=, segments=[N, n]): several copies packed in one input row each, sharing a prefix
    packs_copies: bool = False
    # (sampler, option, value, when): the settings measured fastest on this model, used where the caller
    # passes none (``generate``, ``dllm generate/eval/bench``) and only while the options in ``when``
    # ((option, value) pairs) have those values; exact samplers' laws do not depend on them.
    sampler_defaults: tuple[tuple[str, str, object, tuple[tuple[str, object], ...]], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "context_length", _positive_int(self.context_length))
        object.__setattr__(self, "block_size", _positive_int(self.block_size))
        if self.block_anchor not in BLOCK_ANCHORS:
            raise ValueError(f"block_anchor must be one of {BLOCK_ANCHORS}, got {self.block_anchor!r}")


def _positive_int(value) -> int | None:
    """An int of any integer type (numpy's too) above 0, else None: what a size attribute means."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = operator.index(value)
    except TypeError:
        return None
    return value if value > 0 else None


def sampler_defaults_record(table: dict | None, where: str) -> tuple:
    """A model's table of measured settings, ``{sampler: {option: value, "when": {option: value}}}`` (a folder's
    ``sampler_defaults.json`` or a two-stream marker), as ``Capabilities.sampler_defaults``; a ValueError naming
    ``where`` when it is not such a table."""
    table = table or {}
    if not isinstance(table, dict) or not all(isinstance(v, dict) and isinstance(v.get("when", {}), dict)
                                              for v in table.values()):
        raise ValueError(f"{where}: sampler_defaults must map sampler names to option tables (with an optional "
                         f"\"when\" table of conditions), got {table!r}")
    return tuple((name, option, value, tuple(values.get("when", {}).items()))
                 for name, values in table.items() for option, value in values.items() if option != "when")


def capabilities(model: object) -> Capabilities:
    """The model's declared record (its ``capabilities`` attribute), else one derived from its attributes."""
    declared = getattr(model, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    # A bare logits function (or a model written against the attributes above): probe it, in this one place.
    cache = callable(getattr(model, "forward_cached", None)) and callable(getattr(model, "new_cache", None))
    made = model.new_cache() if cache else None
    return Capabilities(
        accepts_attention_mask=bool(getattr(model, "accepts_attention_mask", False)),
        padding_note=getattr(model, "padding_note", None),
        context_length=getattr(model, "context_length", None),
        block_size=getattr(model, "block_size", None),
        block_anchor=getattr(model, "block_anchor", "answer"),
        block_logits_only=bool(getattr(model, "block_logits_only", False)),
        run_blocks=bool(getattr(model, "run_blocks", False)),
        needs_prompt=bool(getattr(model, "needs_prompt", False)),
        cache=cache,
        cache_exact=cache and bool(getattr(model, "cache_exact", False)),
        cache_crop=callable(getattr(made, "crop", None)),
        cache_drop=callable(getattr(made, "drop", None)),
        commits_prefix=bool(getattr(model, "commits_prefix", False)),
        structured_verify=callable(getattr(model, "structured_verify", None)),
        native_loop=callable(getattr(model, "native_loop", None)),
    )


def run_block_size(model: object, block_length: int | None) -> int | None:
    """The attention block size of a run decoding in blocks of ``block_length``: that block_length on a model whose
    blocks are a run's choice (``Capabilities.run_blocks``: SDAR, LLaDA2, as their official decoders), else the
    model's own ``block_size`` (None: a model without blocks). The one place a run's block layout is decided."""
    caps = capabilities(model)
    if caps.run_blocks and caps.block_size is not None and block_length is not None:
        return block_length
    return caps.block_size


def gather_positions(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``values`` [N, L, ...] at positions ``at`` [N, K] of each row -> [N, K, ...]: what ``logits_at`` asks of a
    model, and how a session answers it for a model that cannot."""
    index = at.reshape(*at.shape, *([1] * (values.dim() - 2))).expand(*at.shape, *values.shape[2:])
    return values.gather(1, index)


def context_length(model: object) -> int | None:
    """The model's declared context (prompt + new tokens), or None when it declares no limit."""
    return capabilities(model).context_length


def max_prompt_length(model: object, max_new_tokens: int) -> int | None:
    """The longest prompt that fits in the model's context with ``max_new_tokens`` (None: no limit)."""
    limit = context_length(model)
    if limit is None:
        return None
    # A diffusion canvas holds prompt + answer at once; a causal model reads all but its last sampled token.
    return limit - max_new_tokens + (1 if is_causal_model(model) else 0)


def accepts_attention_mask(model: object) -> bool:
    return capabilities(model).accepts_attention_mask


def padding_refusal(model: object) -> str:
    """Why ``model`` cannot take a left-padded batch, naming its own class (wrappers set ``__wrapped__``)."""
    inner = inspect.unwrap(model) if hasattr(model, "__wrapped__") else model
    name = type(inner).__name__
    declared = isinstance(getattr(inner, "capabilities", None), Capabilities)
    if not declared and not hasattr(inner, "accepts_attention_mask"):
        return f"{name} declares no accepts_attention_mask, so padding would be read as tokens"
    note = capabilities(inner).padding_note
    return f"{name} cannot honour left padding (its accepts_attention_mask is False" + (f": {note})" if note else ")")


def rolls_back(cache: object) -> bool:
    """Whether a cache object can roll back rejected drafts: its declared ``croppable`` (default True; a
    property of the cache, which may depend on its layers, so read off the cache, here only)."""
    return bool(getattr(cache, "croppable", True))


def has_cache(model: object) -> bool:
    return capabilities(model).cache


def needs_prompt(model: object) -> bool:
    return capabilities(model).needs_prompt
