"""Hugging Face checkpoints as dllm models: LLaDA, Dream, masked LMs and causal LMs.

Each adapter turns a checkpoint's quirks into the protocols of ``dllm.protocols``:
  - ``LLaDAAdapter``: LLaDA's remote code, ``model(input_ids).logits``, bidirectional.
  - ``DreamAdapter``: Dream's remote code, whose raw logits at i score token i + 1; they are shifted back.
  - ``MaskedLMAdapter``: any ``AutoModelForMaskedLM`` (BERT, ModernBERT, ...) as a one-noise-level diffusion model.
  - ``CausalLMAdapter``: any ``AutoModelForCausalLM`` (Llama, Qwen3, GPT-2, ...) with the exact KV-cache capability.

Every adapter returns float32 logits [B, L, V] on the model's device under ``torch.inference_mode()``, V being
the output layer's size (configs often pad the vocabulary beyond the tokenizer), and carries ``tokenizer``,
``vocab_size``, ``eos_token_id``, ``pad_token_id``, ``stop_token_ids``, ``accepts_attention_mask``, ``device``
and ``dtype``. Diffusion adapters also carry ``mask_token_id`` and set that token's logit to -inf.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import torch
from einops import rearrange
from torch import Tensor
from transformers import DynamicCache

from dllm.counting import Counted, NativeLoop
from dllm.models.cache import SizedCache
from dllm.models.remote import guard
from dllm.numerics import positions_from_mask
from dllm.protocols import Capabilities, gather_positions, padding_refusal

# Chat templates end an assistant turn with one of these (LLaDA/Llama 3, Qwen/Dream, Gemma).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_turn|>", "<end_of_turn>")


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` names a parameter ``name`` (``**kwargs`` does not count: it may drop the value)."""
    return name in inspect.signature(fn).parameters


def _first_id(value: Any) -> int | None:
    """A token id from a field that may hold an int, a list of ints (Llama 3's eos) or None."""
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return None if value is None else int(value)


def _special_id(name: str, tokenizer, config) -> int | None:
    """``{name}_token_id`` from the tokenizer, else from the config."""
    value = getattr(tokenizer, f"{name}_token_id", None)
    return _first_id(value if value is not None else getattr(config, f"{name}_token_id", None))


def special_ids(config, tokenizer) -> tuple[int | None, int | None, tuple[int, ...]]:
    """(eos, pad, stop ids) of a checkpoint: tokenizer first, then config; stops are EOS then end-of-turn tokens."""
    eos, pad = _special_id("eos", tokenizer, config), _special_id("pad", tokenizer, config)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    stops = [eos, *(vocab.get(token) for token in END_OF_TURN_TOKENS)]
    return eos, pad, tuple(dict.fromkeys(i for i in stops if i is not None))  # EOS first


def _decoder_and_head(model) -> tuple[Any, Any, str] | None:
    """(decoder, output layer, the decoder's cache keyword) when the model's logits are the output layer on the
    decoder's last states, checked once on a short input (a final soft-cap or logit scale makes them differ);
    None otherwise: then sessions gather from the full logits."""
    getters = ("get_decoder", "get_output_embeddings")
    if not all(callable(getattr(model, name, None)) for name in getters):
        return None
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is model:
        return None
    device = next(model.parameters()).device
    probe = torch.tensor([[0, 1, 2]], device=device)
    with torch.inference_mode():
        try:
            full = model(input_ids=probe, use_cache=False).logits
            split = head(decoder(input_ids=probe, use_cache=False).last_hidden_state)
        except (TypeError, AttributeError, ValueError):
            return None
    if split.shape != full.shape or not torch.equal(split, full):
        return None
    return decoder, head, "cache" if _takes(decoder.forward, "cache") else "past_key_values"


def _output_size(model) -> int:
    """The logits' last dim: rows of the output layer, else ``config.vocab_size``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def _padding_mask(attention_mask: Tensor | None, input_ids: Tensor) -> Tensor | None:
    """The 0/1 mask as long on the inputs' device, or None when it hides nothing (then the plain path runs)."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    return None if bool(mask.all()) else mask


# Where configs declare their context, in lm-eval's order (HFLM.max_length) plus LLaDA's max_sequence_length.
CONTEXT_ATTRIBUTES = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")


def config_context_length(config) -> int | None:
    """The first positive int among CONTEXT_ATTRIBUTES of the (text) config, else None (no declared limit)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in CONTEXT_ATTRIBUTES:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class _HFAdapter:
    """Shared plumbing: the wrapped model, its tokenizer, special ids, device and dtype."""

    accepts_attention_mask = True

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.vocab_size = _output_size(model)
        self.eos_token_id, self.pad_token_id, self.stop_token_ids = special_ids(model.config, tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int | None:
        """The positions the checkpoint's config declares (prompt + new tokens), None if it declares none."""
        return config_context_length(self.config)

    # Why padding cannot be honoured when accepts_attention_mask is False (subclasses say more).
    padding_note = "its forward takes no position_ids, so padding would shift every position"

    @property
    def capabilities(self) -> Capabilities:
        """The record samplers read (dllm.protocols); subclasses add what they offer."""
        return Capabilities(accepts_attention_mask=bool(self.accepts_attention_mask), padding_note=self.padding_note,
                            context_length=self.context_length)

    def _refuse_padding(self) -> None:
        raise ValueError(f"{padding_refusal(self)}; pass equal-length rows without padding (or one row per call)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, vocab_size={self.vocab_size})"


# ------------------------------------------------------------------ diffusion adapters


def find_mask_token_id(config, tokenizer, token_names: tuple[str, ...] = ()) -> int | None:
    """The mask id from ``config.mask_token_id``, else ``tokenizer.mask_token_id``, else a named token.

    Raises when config and tokenizer both name one and they differ (a silent pick could be the wrong one).
    """
    from_config = _first_id(getattr(config, "mask_token_id", None))
    from_tokenizer = _first_id(getattr(tokenizer, "mask_token_id", None))
    if from_config is not None and from_tokenizer is not None and from_config != from_tokenizer:
        raise ValueError(f"config.mask_token_id ({from_config}) and tokenizer.mask_token_id ({from_tokenizer}) "
                         "differ; pass mask_token_id= to choose")
    if from_config is not None or from_tokenizer is not None:
        return from_config if from_config is not None else from_tokenizer
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return next((vocab[name] for name in token_names if name in vocab), None)


class _DiffusionAdapter(_HFAdapter):
    """A masked-diffusion denoiser: ``logits[:, i]`` scores the clean token at i; the mask's logit is -inf."""

    mask_token_names: tuple[str, ...] = ()  # tokens that mean "mask" when config and tokenizer name none

    def __init__(self, model, tokenizer=None, mask_token_id: int | None = None):
        super().__init__(model, tokenizer)
        if mask_token_id is None:
            mask_token_id = find_mask_token_id(model.config, tokenizer, self.mask_token_names)
        if mask_token_id is None:
            names = f" nor one of the tokens {list(self.mask_token_names)}" if self.mask_token_names else ""
            raise ValueError(f"{type(self).__name__} needs a mask token, but config.mask_token_id is missing and "
                             f"the tokenizer has no mask_token{names}; pass mask_token_id= to dllm.load")
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) \
                or not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be an int in [0, vocab_size={self.vocab_size}), "
                             f"got {mask_token_id!r}")
        self.mask_token_id = mask_token_id

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Clean-token logits at every position; attention_mask [B, L] is 0 on left padding.  # -> [B, L, V]"""
        input_ids = input_ids.to(self.device)
        logits = self._logits(input_ids, _padding_mask(attention_mask, input_ids)).float()
        logits[..., self.mask_token_id] = float("-inf")
        return logits

    def _logits(self, input_ids: Tensor, mask: Tensor | None) -> Tensor:
        raise NotImplementedError


def _honours_padding(logits_fn, device: torch.device) -> bool:
    """Whether a masked-out token leaves the other positions' logits unchanged (one call on two rows).

    The rows differ only in their first token, which the mask hides: a model that honours the mask gives
    both rows the same logits elsewhere (the same kernel on the same numbers), one that ignores it does not.
    """
    input_ids = torch.tensor([[0, 2, 3, 4], [1, 2, 3, 4]], device=device)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], device=device)
    with torch.inference_mode():
        logits = logits_fn(input_ids, mask).float()[:, 1:]  # [2, 3, V]
    return bool((logits[0] - logits[1]).abs().max() <= 1e-3 * logits[0].abs().max())


class LLaDAAdapter(_DiffusionAdapter):
    """LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): ``model(input_ids).logits``, bidirectional.

    Mask id: ``config.mask_token_id`` (126336, the ``<|mdm_mask|>`` token; the tokenizer sets no mask_token).
    Padding: modeling_llada.py always took ``attention_mask`` but ignored it until GSAI-ML's 2025-10-21 update.
    So at construction a two-row probe (``_honours_padding``) checks the loaded code; if the mask is ignored,
    ``accepts_attention_mask`` is False and a padded call raises instead of returning wrong logits. Rotary
    positions there count from index 0 even on padded rows; that is harmless, because with padding keys
    masked, rotary attention depends only on relative positions.
    """

    mask_token_names = ("<|mdm_mask|>",)
    padding_note = "its modeling_llada.py ignores attention_mask (code before the 2025-10-21 update)"

    def __init__(self, model, tokenizer=None, mask_token_id: int | None = None):
        super().__init__(model, tokenizer, mask_token_id)
        # transformers 5 drops use_cache from LLaDA's config, and its forward reads config.use_cache when None.
        self._extra = {"use_cache": False} if _takes(model.forward, "use_cache") else {}
        self.accepts_attention_mask = _takes(model.forward, "attention_mask") and _honours_padding(
            lambda ids, mask: self.model(input_ids=ids, attention_mask=mask, **self._extra).logits, self.device)

    def _logits(self, input_ids: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            return self.model(input_ids=input_ids, **self._extra).logits
        if not self.accepts_attention_mask:
            self._refuse_padding()
        return self.model(input_ids=input_ids, attention_mask=mask, **self._extra).logits


class DreamAdapter(_DiffusionAdapter):
    """Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): raw logits[:, i] score token i + 1, so they shift right.

    As in Dream's generation_utils: ``logits = cat([raw[:, :1], raw[:, :-1]])``, so position 0 keeps raw[:, 0]
    (never read: the first token is part of the prompt). Padding goes in as Dream's generation code sends it, a
    boolean [B, 1, L, L] mask plus position ids counting real tokens, except that padding queries may attend to
    real keys: a query row with no key at all gives NaN on some SDPA backends, and its output is never read.
    """

    mask_token_names = ("<|mask|>",)

    def _logits(self, input_ids: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            raw = self.model(input_ids=input_ids).logits
        else:
            keys = rearrange(mask.bool(), "b k -> b 1 1 k").expand(-1, -1, input_ids.shape[1], -1)
            raw = self.model(input_ids=input_ids, attention_mask=keys, position_ids=positions_from_mask(mask)).logits
        return torch.cat((raw[:, :1], raw[:, :-1]), dim=1)

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, native_loop=True)

    def native_loop(self, prompt: Tensor, max_new_tokens: int, *, temperature: float,
                    attention_mask: Tensor | None = None, eos_token_id=None, **generate_kwargs) -> NativeLoop:
        """Dream's own ``diffusion_generate`` (its remote code) for ``sampler="native"``.

        ``temperature`` goes to it as is; ``steps``, ``alg``, ``top_p``... through ``generate_kwargs`` (its
        defaults otherwise). Every call of the model is one denoising step.
        """
        if not callable(getattr(self.model, "diffusion_generate", None)):
            raise TypeError("sampler='native' needs the checkpoint's diffusion_generate (Dream's remote code); "
                            f"{type(self.model).__name__} has none")
        device = self.device
        mask = torch.ones_like(prompt) if attention_mask is None else attention_mask

        def run():
            with guard(type(self.model).__name__, "dream", "sampling from"):
                return self.model.diffusion_generate(prompt.to(device), attention_mask=mask.to(device),
                                                     max_new_tokens=max_new_tokens, temperature=float(temperature),
                                                     return_dict_in_generate=True, **generate_kwargs)

        pad = self.pad_token_id if self.pad_token_id is not None else 0
        return NativeLoop(run, [Counted(self.model, steps=True)], "steps", pad, device)


class MaskedLMAdapter(_DiffusionAdapter):
    """Any Hugging Face masked LM (BERT, RoBERTa, ModernBERT, ...) as a one-noise-level masked diffusion model.

    Mask id: ``config.mask_token_id``, else ``tokenizer.mask_token_id``. Padding: position ids come from the
    mask, so a left-padded row sees the positions of the unpadded one (offset by padding_idx + 1 for
    RoBERTa-style embeddings, which count from there). A model whose forward takes no position_ids
    (DistilBERT) cannot honour left padding: ``accepts_attention_mask`` is False and padded calls raise.
    """

    def __init__(self, model, tokenizer=None, mask_token_id: int | None = None):
        super().__init__(model, tokenizer, mask_token_id)
        self.accepts_attention_mask = _takes(model.forward, "position_ids")
        embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
        padding_idx = getattr(embeddings, "padding_idx", None)
        self._position_offset = 0 if padding_idx is None else padding_idx + 1

    def _logits(self, input_ids: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            return self.model(input_ids=input_ids).logits
        if not self.accepts_attention_mask:
            self._refuse_padding()
        positions = positions_from_mask(mask) + self._position_offset
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits


# ------------------------------------------------------------------ causal adapter and its cache


def select_rows(kv: DynamicCache, rows: Tensor) -> DynamicCache:
    """A copy of ``kv`` holding the given rows (repeats allowed).  # rows [N]

    The layer objects are copied and their tensors indexed: a cache rebuilt from tensors alone would lose what
    a sliding-window layer counts beyond the entries it keeps (transformers' cumulative_length), and masks
    built from that count would misalign.
    """
    out = copy.copy(kv)
    out.layers = [copy.copy(layer) for layer in kv.layers]
    for layer in out.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    return out


class HFCache(SizedCache):
    """A Hugging Face ``DynamicCache`` plus the 0/1 mask of the keys it holds (0 = left padding).

    The KV-cache capability of ``dllm.protocols``: ``length`` counts cached positions (padding included),
    ``crop(length)`` rolls back in place (all rows alike), ``select(rows)`` returns a new cache of those rows.
    """

    def __init__(self, config, kv: DynamicCache | None = None, key_mask: Tensor | None = None):
        self.config = config
        self.kv = kv if kv is not None else DynamicCache(config=config)
        self.key_mask = key_mask  # [B, length] long; None while empty

    def _sized_by(self) -> Tensor | None:
        return self.key_mask

    @property
    def croppable(self) -> bool:
        """False when a sliding-window or linear-attention layer cannot roll back (``crop`` would raise)."""
        return bool(getattr(self.kv, "is_croppable", True))

    def past_mask(self, rows: int, device: torch.device) -> Tensor:
        """The cached keys' mask, [rows, 0] while empty.  # [B, length]"""
        return torch.zeros(rows, 0, dtype=torch.long, device=device) if self.key_mask is None else self.key_mask

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (e.g. drop rejected drafts)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"crop length must be an int in [0, {self.length}], got {length!r}")
        if length == self.length:
            return
        if not self.croppable:
            raise ValueError("this model's cache has sliding-window or linear-attention layers; it cannot roll back")
        self.kv.crop(length - self.length)  # transformers 5: a negative count removes that many positions
        self.key_mask = self.key_mask[:, :length] if length else None

    def select(self, rows: Tensor) -> HFCache:
        """A new cache holding the given rows, repeats allowed (e.g. one per verification copy).  # rows [N]"""
        if self.key_mask is None:
            return HFCache(self.config)
        rows = rows.to(self.key_mask.device)
        return HFCache(self.config, select_rows(self.kv, rows), self.key_mask[rows])


def _tree_mask_4d(keys: Tensor, tree: Tensor, past: int, dtype: torch.dtype) -> Tensor:
    """transformers' custom 4-D additive mask for a draft tree: cached keys where ``keys`` [N, P + n] (0/1) is 1,
    new keys where ``tree`` [N, n, n] is True, and every query its own key (a padding query stays finite).
    # -> [N, 1, n, P + n]"""
    n = tree.shape[1]
    allowed = keys.bool()[:, None, :].expand(-1, n, -1).clone()
    allowed[:, :, past:] &= tree
    allowed[:, :, past:] |= torch.eye(n, dtype=torch.bool, device=tree.device)
    return torch.zeros(allowed.shape, dtype=dtype, device=tree.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


class CausalLMAdapter(_HFAdapter):
    """Any ``AutoModelForCausalLM`` (Llama, Qwen3, GPT-2, ...) as a CausalModel with an exact KV cache.

    ``logits[:, i]`` scores token i + 1. It has no ``mask_token_id`` attribute (that attribute marks diffusion
    models); a tokenizer's mask id, if any, is kept as ``tokenizer_mask_token_id``. Padding follows HF
    generate: position ids count real tokens (cumsum - 1), and cached calls continue each row's count.
    """

    cache_exact = True

    @property
    def capabilities(self) -> Capabilities:
        """An exact KV cache that crops (a sliding-window one says so on the cache: ``croppable``), own generate."""
        return dataclasses.replace(super().capabilities, cache=True, cache_exact=self.cache_exact, cache_crop=True,
                                   native_loop=True, logits_at=self._split is not None,
                                   tree_attention=bool(self.accepts_attention_mask) and self._full_attention)

    def __init__(self, model, tokenizer=None):
        super().__init__(model, tokenizer)
        self.tokenizer_mask_token_id = getattr(tokenizer, "mask_token_id", None)
        self.accepts_attention_mask = _takes(model.forward, "position_ids")
        # A draft tree's custom mask replaces every layer's own: only for models whose layers all attend fully
        # (a sliding-window or linear-attention cache is the one that cannot crop).
        self._full_attention = HFCache(model.config).croppable
        # transformers 5.2x renamed past_key_values to cache (the old name still works until 5.40).
        self._cache_arg = "cache" if _takes(model.forward, "cache") else "past_key_values"
        self._split = _decoder_and_head(model)

    def _logits(self, logits_at: Tensor | None, **inputs) -> Tensor:
        """The model's logits [N, n, V] float32, or with ``logits_at`` [N, K] its decoder's last states gathered
        there and the output layer on those only, in the model's dtype (``Capabilities.logits_at``)."""
        if logits_at is None:
            return self.model(**inputs).logits.float()
        if self._split is None:
            raise ValueError(f"logits_at: {type(self.model).__name__}'s logits are not its output layer on its "
                             "decoder's last states (Capabilities.logits_at is False)")
        decoder, head, cache_arg = self._split
        if self._cache_arg in inputs:
            inputs[cache_arg] = inputs.pop(self._cache_arg)
        states = decoder(**inputs).last_hidden_state
        return head(gather_positions(states, logits_at.to(states.device)))

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                 logits_at: Tensor | None = None) -> Tensor:
        """Next-token logits; attention_mask [B, L] is 0 on left padding.  # [B, L] -> [B, L, V] float32
        ``logits_at`` [B, K]: at those positions only, in the model's dtype (dllm.protocols)."""
        input_ids = input_ids.to(self.device)
        mask = _padding_mask(attention_mask, input_ids)
        if mask is None:
            return self._logits(logits_at, input_ids=input_ids, use_cache=False)
        if not self.accepts_attention_mask:
            self._refuse_padding()
        return self._logits(logits_at, input_ids=input_ids, attention_mask=mask,
                            position_ids=positions_from_mask(mask), use_cache=False)

    def new_cache(self) -> HFCache:
        """An empty cache for ``forward_cached``."""
        return HFCache(self.model.config)

    def native_loop(self, prompt: Tensor, max_new_tokens: int, *, temperature: float,
                    attention_mask: Tensor | None = None, eos_token_id=None, drafter=None,
                    **generate_kwargs) -> NativeLoop:
        """transformers' ``generate`` for ``sampler="native"``; with ``drafter`` (a loaded causal checkpoint),
        its assisted generation, which takes one row at a time.

        It samples what ``ar`` samples: the full softmax(logits / T), greedy at T = 0. For the call, the
        checkpoint's ``generation_config`` (and the assistant's) is swapped for a neutral one, because
        transformers fills every unset field from it (a repetition penalty, suppressed tokens, beams...);
        ``generate_kwargs`` add processors on purpose. The assistant's calls count as draft calls. A round
        is one row's target call while it runs, so mean_acceptance_length reads as tokens per target call.
        """
        if drafter is not None and drafter.model is self.model:
            raise ValueError("sampler='native' with a drafter needs a separate assistant model: the same object "
                             "would count every call twice (load the checkpoint a second time to self-draft)")
        if drafter is not None and prompt.shape[0] != 1:
            raise ValueError("transformers' assisted generation takes batch size 1; got "
                             f"{prompt.shape[0]} rows (ar_spec takes any batch)")
        from transformers import GenerationConfig

        models = [self.model] + ([drafter.model] if drafter is not None else [])
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        device = self.device
        mask = torch.ones_like(prompt) if attention_mask is None else attention_mask  # never inferred from pad
        options = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, attention_mask=mask.to(device))
        if temperature > 0:
            options.update(temperature=float(temperature), top_k=0, top_p=1.0)
        if drafter is not None:
            options["assistant_model"] = drafter.model

        def run():
            saved = [model.generation_config for model in models]
            try:
                for model in models:
                    model.generation_config = GenerationConfig(
                        pad_token_id=pad, eos_token_id=None if eos_token_id is None else list(eos_token_id))
                return self.model.generate(input_ids=prompt.to(device), **options, **generate_kwargs)
            finally:
                for model, config in zip(models, saved, strict=True):
                    model.generation_config = config

        counted = [Counted(self.model, steps=True)] + ([Counted(drafter.model, draft=True)] if drafter else [])
        return NativeLoop(run, counted, "calls" if drafter is not None else "tokens", pad, device)

    @torch.inference_mode()
    def forward_cached(
        self,
        input_ids: Tensor,  # [N, n]
        cache: HFCache,
        *,
        rows: Tensor | None = None,  # [N] cache row serving each input; only with append=False
        append: bool = True,
        attention_mask: Tensor | None = None,  # [N, cache.length + n] over cached + new keys
        block_offset: Tensor | None = None,
        position_ids: Tensor | None = None,  # [N, n]; default: continue each row's count
        tree_mask: Tensor | None = None,  # [N, n, n] bool: which new tokens each new token sees (a draft tree)
        logits_at: Tensor | None = None,  # [N, K] new positions whose logits are wanted (as ``__call__``)
    ) -> Tensor:
        """Logits of new tokens after the cached prefix, positions continuing each row's count.  # [N, n, V]

        ``append`` grows ``cache`` by the new tokens; otherwise ``rows`` picks a cache row per input and the
        cache is left unchanged. Without ``attention_mask`` the cached keys keep the mask they were stored with.
        ``tree_mask`` (``Capabilities.tree_attention``) with the tree's ``position_ids``: a custom 4-D mask,
        cached keys as the padding mask says and the new ones as the tree says.
        """
        if block_offset is not None:
            raise ValueError("block_offset is for block-causal models; a causal LM has no blocks")
        input_ids = input_ids.to(self.device)
        past = self._past(cache, rows, append, input_ids.shape[0])
        mask = self._full_mask(attention_mask, past.past_mask(input_ids.shape[0], input_ids.device), input_ids)
        padded = not bool(mask.all())
        if padded and not self.accepts_attention_mask:
            self._refuse_padding()
        positions = positions_from_mask(mask)[:, past.length:] if position_ids is None else position_ids.to(self.device)
        model_mask = mask if padded else None
        if tree_mask is not None:
            if not self.capabilities.tree_attention:
                raise ValueError(f"tree_mask: {type(self.model).__name__} takes no custom attention mask here "
                                 "(Capabilities.tree_attention is False)")
            model_mask = _tree_mask_4d(mask, tree_mask.to(self.device), past.length, self.model.dtype)
        logits = self._logits(logits_at, input_ids=input_ids, attention_mask=model_mask, position_ids=positions,
                              use_cache=True, **{self._cache_arg: past.kv})  # past.kv grows in place
        if append:
            cache.key_mask = mask
        return logits

    @staticmethod
    def _past(cache: HFCache, rows: Tensor | None, append: bool, n_inputs: int) -> HFCache:
        """The cache to attend to: ``cache`` itself when appending, else a copy of the named rows."""
        if append:
            if rows is not None:
                raise ValueError("rows must be None when append=True (the cache grows row for row)")
            if cache.length and cache.batch_size != n_inputs:
                raise ValueError(f"cache holds {cache.batch_size} rows but {n_inputs} inputs were given")
            return cache
        if rows is None:
            raise ValueError("append=False needs rows: the cache row serving each input, a LongTensor [N]")
        if rows.shape != (n_inputs,):
            raise ValueError(f"rows must have shape [{n_inputs}], got {tuple(rows.shape)}")
        return cache.select(rows)

    @staticmethod
    def _full_mask(attention_mask: Tensor | None, past_mask: Tensor, input_ids: Tensor) -> Tensor:
        """The 0/1 mask over cached + new keys.  # [N, P + n] long"""
        if attention_mask is None:
            return torch.cat((past_mask, torch.ones_like(input_ids)), dim=1)
        expected = (input_ids.shape[0], past_mask.shape[1] + input_ids.shape[1])
        if tuple(attention_mask.shape) != expected:
            raise ValueError(f"attention_mask must cover cached + new keys, shape {list(expected)}, "
                             f"got {list(attention_mask.shape)}")
        return attention_mask.to(device=input_ids.device, dtype=torch.long)
