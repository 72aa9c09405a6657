"""Native LLaDA, Dream, SDAR and LLaDA2: the hub's config.json, safetensors and tokenizer.json read into TransformerLM.

No file of the checkpoint is imported or executed (no ``trust_remote_code``), so transformers upgrades cannot
break these families and the project's caches and structured verifier apply. Semantics follow the real
modelling code (``shared/remote_code``, checked by parity tests):
  - LLaDA (``modeling_llada.py``, block_type "llama"): pre-norm RMSNorm blocks, rotate-half RoPE in float32,
    SwiGLU ``ff_out(silu(ff_proj(x)) * up_proj(x))``, bidirectional attention; the output layer has
    ``embedding_size`` rows (>= vocab_size); ``weight_tying`` reuses ``wte``; ``attention_mask`` [B, L]
    hides padding keys (GSAI-ML's hub code since 2025-10-21).
  - Dream (``modeling_dream.py``, Qwen2-style): q/k/v biases, grouped-query attention, ``rope_theta``,
    ``rms_norm_eps``, bidirectional attention; raw logits at i score token i + 1, so logits at p read the
    state at p - 1 (``shift_logits``, as Dream's ``diffusion_generate`` shifts them).
  - SDAR (``modeling_sdar.py``, JetAstra's; TraDo has the same ``model_type: sdar``): Qwen3's dense layout, i.e.
    Dream's without biases plus an RMSNorm of each query and key head before rotary (``qk_norm``), a
    ``head_dim`` of its own (SDAR-4B: 32 heads of 128 over hidden 2560); block-causal attention (bidirectional
    inside blocks of ``block_size``, causal across them) with blocks anchored at absolute position 0, so the
    prompt is block-causal too (``Capabilities.block_anchor`` "absolute"; the official
    ``block_diffusion_generate`` builds that mask); logits are not shifted (position i scores token i). The hub's
    config.json names neither the block size nor the mask token (servers hard-code them): ``block_size`` comes
    from ``dllm.load(..., block_size=)``, else config.json's ``block_size``, else 4 (the public chat models' block
    in training); it is the default of a run's blocks, which are the decoder's choice as in
    ``block_diffusion_generate`` (``Capabilities.run_blocks``: a sampler's ``block_length`` sets the attention
    blocks, said in one UserWarning when it differs from ``block_size``); the mask id from ``mask_token_id=``,
    config.json, the tokenizer's mask token (``<|MASK|>``; ``<MASK>`` in the training repository's
    added_tokens.json), else 151669 (SDAR-4B-Chat's).
  - LLaDA2.0 / LLaDA2.1 (``modeling_llada2_moe.py``, inclusionAI's; ``model_type`` llada2_moe, class
    ``LLaDA2MoeModelLM``; 2.1 is the same network with another ``generate``): block-causal like SDAR, blocks anchored
    at absolute position 0, unshifted logits; one fused ``query_key_value`` ([q heads | k heads | v heads] rows, our
    ``wqkv`` as is), per-head q/k RMSNorm before rotary, rotate-half RoPE on the first ``partial_rotary_factor`` of
    each head's channels (``rotary_dim``; config.json's own ``rotary_dim`` key is not read by the real code, nor here),
    an untied output layer; after ``first_k_dense_replace`` dense SwiGLU layers, a mixture of experts
    (``MoEConfig``): sigmoid router scores in float32 plus ``expert_bias`` choose ``num_experts_per_tok`` experts
    among the ``topk_group`` best of ``n_group`` groups, weighted by their unbiased scores renormalised (the real code
    always renormalises when more than one expert is chosen: ``norm_topk_prob`` is not read by it, nor here) times
    ``routed_scaling_factor``, plus ``num_shared_experts`` shared experts. Block size: ``block_size=``, else
    config.json's ``block_size``, else 32 (the official ``generate``'s ``block_length`` default; the hub config does
    not say); as for SDAR it is the default of a run's blocks (``generate`` builds its mask from its own
    ``block_length``, and so does a run here: ``Capabilities.run_blocks``); mask id: ``mask_token_id=``,
    config.json, the tokenizer's ``<|mask|>``, else 156895; EOS: the tokenizer's, config.json's,
    generation_config.json's, else 156892 (the official ``generate``'s defaults).
All compute RoPE and RMSNorm in float32 whatever the weights' dtype (the real Dream, SDAR and LLaDA2 code rotates in
the model dtype; in float32 the two are the same).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dllm.models.checkpoint import Target, load_checkpoint
from dllm.models.hf import DreamAdapter, LLaDAAdapter, find_mask_token_id, special_ids
from dllm.models.remote import FAMILIES as REMOTE_FAMILIES
from dllm.models.transformer import MoEConfig, TransformerConfig, TransformerLM
from dllm.numerics import check_int
from dllm.protocols import Capabilities

FAMILIES = ("llada", "dream", "sdar", "llada2")
# What a hub download fetches: configs, weights and tokenizer files, never the checkpoint's Python code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
_OPTIONS = ("device_map", "tokenizer", "mask_token_id", "block_size", "revision", "token", "cache_dir",
            "local_files_only")
SDAR_BLOCK_SIZE = 4  # the public SDAR / TraDo chat models' training block; their config.json does not say it
SDAR_MASK_TOKEN_ID = 151669  # SDAR-4B-Chat's mask token, hard-coded by its servers when nothing names it
LLADA2_BLOCK_SIZE = 32  # LLaDA2's generate() block_length default; the hub config.json does not say
LLADA2_MASK_TOKEN_ID = 156895  # <|mask|>: LLaDA2's generate() mask_id default
LLADA2_EOS_TOKEN_ID = 156892  # <|endoftext|>: LLaDA2's generate() eos_id default


class NativeLM(TransformerLM):
    """A LLaDA, Dream, SDAR or LLaDA2 checkpoint as a TransformerLM, carrying what samplers read from an adapter.

    Inference only: calls run under ``torch.inference_mode()`` and parameters need no gradient. Logits are
    float32 [B, L, V], V the output layer's rows; the mask token's logit is -inf.
    """

    def __init__(self, config: TransformerConfig, family: str):
        super().__init__(config)
        self.family = family
        self.tokenizer = None
        self.stop_token_ids: tuple[int, ...] = ()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def capabilities(self) -> Capabilities:
        """TransformerLM's record plus where this family's blocks start (SDAR: "absolute", at position 0) and
        whether a run chooses them (SDAR, LLaDA2: their official decoders build the block mask from their own
        block_length)."""
        family = _FAMILIES[self.family]
        return dataclasses.replace(super().capabilities, block_anchor=family.block_anchor,
                                   run_blocks=family.run_blocks)

    @torch.inference_mode()
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)

    @torch.inference_mode()
    def forward_cached(self, *args, **kwargs):
        return super().forward_cached(*args, **kwargs)

    @torch.inference_mode()
    def structured_verify(self, *args, **kwargs):
        return super().structured_verify(*args, **kwargs)

    def __repr__(self) -> str:
        c = self.config
        blocks = f", block_size={c.block_size}" if c.block_size is not None else ""
        experts = f", experts={c.moe.n_experts} (top {c.moe.experts_per_token})" if c.moe is not None else ""
        return (f"NativeLM({self.family}, dim={c.dim}, n_layers={c.n_layers}, n_heads={c.n_heads}, "
                f"n_kv_heads={c.n_kv_heads}, head_dim={c.head_dim}, vocab_size={self.vocab_size}{blocks}{experts})")


# ------------------------------------------------------------------ hub config.json -> TransformerConfig


def _require(hub: dict, family: str, supported: dict[str, tuple]) -> None:
    """Refuse config values the native model does not implement (a silent mismatch would be wrong logits)."""
    for key, (default, *allowed) in supported.items():
        value = hub.get(key, default)
        if value not in allowed:
            raise ValueError(f"native {family}: config.json {key}={value!r} is not supported (allowed: {allowed}); "
                             f"{_elsewhere(family)}")


def _elsewhere(family: str) -> str:
    """Where a checkpoint the native model refuses can still run (the end of a refusal's message)."""
    if family in REMOTE_FAMILIES:
        return "load with kind='remote' to run the checkpoint's own code"
    return f"dllm has no other loader for {family} checkpoints (it never runs their hub code)"


# key: (the real code's default when absent, allowed values...)
_LLADA_SUPPORTED = {
    "block_type": ("sequential", "llama"), "layer_norm_type": ("default", "rms"), "activation_type": ("swiglu", "silu"),
    "rope": (False, True), "alibi": (False, False), "include_bias": (False, False),
    "bias_for_layer_norm": (None, None, False), "layer_norm_with_affine": (True, True),
    "attention_layer_norm": (False, False), "scale_logits": (False, False), "input_emb_norm": (False, False),
    "block_group_size": (1, 1), "multi_query_attention": (None, None, False),
}
_DREAM_SUPPORTED = {
    "hidden_act": ("silu", "silu"), "rope_scaling": (None, None), "use_sliding_window": (False, False),
}
_SDAR_SUPPORTED = {  # attention_bias would put biases on q/k/v and the output projection, which has none here
    "hidden_act": ("silu", "silu"), "attention_bias": (False, False), "use_sliding_window": (False, False),
}
_LLADA2_SUPPORTED = {  # (configuration_llada2_moe.py's defaults: use_bias is True there, False in every release)
    "hidden_act": ("silu", "silu"), "use_qkv_bias": (False, False), "use_bias": (True, False),
    "use_qk_norm": (True, True, False), "use_sliding_window": (False, False), "score_function": ("sigmoid", "sigmoid"),
}


def _rope_theta(hub: dict, family: str, default: float) -> float:
    """RoPE theta from ``rope_theta`` or transformers 5's ``rope_parameters`` (configs it saves keep theta only
    there); a rotary type other than "default" (linear, yarn, ...) is refused, as is a theta the two disagree on."""
    parameters = hub.get("rope_parameters")
    if parameters is None:
        return float(hub.get("rope_theta", default))
    if not isinstance(parameters, dict):
        raise ValueError(f"native {family}: config.json rope_parameters must be a dict, got {parameters!r}")
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        raise ValueError(f"native {family}: config.json rope_parameters rope_type={kind!r} is not supported "
                         f"(allowed: ['default']); {_elsewhere(family)}")
    theta = parameters.get("rope_theta", hub.get("rope_theta", default))
    if "rope_theta" in hub and float(hub["rope_theta"]) != float(theta):
        raise ValueError(f"native {family}: config.json rope_theta={hub['rope_theta']!r} and "
                         f"rope_parameters['rope_theta']={theta!r} differ; fix the config to the model's value")
    return float(theta)


def _rope_scaling(hub: dict, family: str) -> None:
    """Refuse a ``rope_scaling`` other than none (or its "default" kind): linear, dynamic, yarn, ... rescale the
    rotary angles, which the native model does not."""
    scaling = hub.get("rope_scaling")
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind != "default":
        raise ValueError(f"native {family}: config.json rope_scaling={scaling!r} is not supported (allowed: null "
                         f"or rope_type 'default'); {_elsewhere(family)}")


def _block_size(hub: dict, family: str, given: int | None, default: int) -> int:
    """The block size: ``given`` (checked at the door), else config.json's ``block_size``, else ``default``."""
    if given is not None:
        return given
    value = hub.get("block_size", default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"native {family}: config.json block_size must be a positive int, got {value!r}; fix the "
                         f"config or pass block_size= to dllm.load")
    return value


def llada_config(hub: dict, mask_token_id: int, eos_token_id, pad_token_id) -> TransformerConfig:
    """TransformerConfig of a LLaDA config.json (configuration_llada.py's keys and defaults)."""
    _require(hub, "llada", _LLADA_SUPPORTED)
    dim, heads = hub.get("d_model", 768), hub.get("n_heads", 12)
    n_kv = hub.get("n_kv_heads") or heads
    if hub.get("multi_query_attention") is False and n_kv != heads:
        raise ValueError(f"native llada: multi_query_attention=False needs n_kv_heads == n_heads, got {n_kv}")
    return TransformerConfig(
        vocab_size=hub.get("embedding_size") or hub.get("vocab_size", 50257),  # the output layer's rows
        dim=dim, n_layers=hub.get("n_layers", 12), n_heads=heads, n_kv_heads=n_kv,
        mlp_hidden=hub.get("mlp_hidden_size") or hub.get("mlp_ratio", 4) * dim,
        max_seq_len=hub.get("max_sequence_length", 1024), rope_theta=_rope_theta(hub, "llada", 10000.0),
        layout="bidirectional", mask_token_id=mask_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        norm_eps=float(hub.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hub.get("weight_tying", True)),
        qkv_bias=bool(hub.get("include_qkv_bias") or False))


def dream_config(hub: dict, mask_token_id: int, eos_token_id, pad_token_id) -> TransformerConfig:
    """TransformerConfig of a Dream config.json (configuration_dream.py's keys and defaults)."""
    _require(hub, "dream", _DREAM_SUPPORTED)
    heads = hub.get("num_attention_heads", 32)
    return TransformerConfig(
        vocab_size=hub.get("vocab_size", 151936), dim=hub.get("hidden_size", 4096),
        n_layers=hub.get("num_hidden_layers", 32), n_heads=heads, n_kv_heads=hub.get("num_key_value_heads") or heads,
        mlp_hidden=hub.get("intermediate_size", 22016), max_seq_len=hub.get("max_position_embeddings", 32768),
        rope_theta=_rope_theta(hub, "dream", 10000.0), layout="bidirectional", mask_token_id=mask_token_id,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, norm_eps=float(hub.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hub.get("tie_word_embeddings", False)), qkv_bias=True, shift_logits=True)


def sdar_config(hub: dict, mask_token_id: int, eos_token_id, pad_token_id,
                block_size: int | None = None) -> TransformerConfig:
    """TransformerConfig of an SDAR config.json (configuration_sdar.py's keys and defaults): block-causal, blocks of
    ``block_size`` (None: config.json's ``block_size``, else SDAR_BLOCK_SIZE), per-head q/k norms, unshifted logits.
    A ``head_dim`` of null is hidden / heads (Qwen3's rule; SDAR's own code needs it set)."""
    _require(hub, "sdar", _SDAR_SUPPORTED)
    _rope_scaling(hub, "sdar")
    heads = hub.get("num_attention_heads", 32)
    dim = hub.get("hidden_size", 4096)
    head_dim = hub.get("head_dim", 128)
    return TransformerConfig(
        vocab_size=hub.get("vocab_size", 151936), dim=dim, n_layers=hub.get("num_hidden_layers", 32),
        n_heads=heads, n_kv_heads=hub.get("num_key_value_heads") or heads,
        head_dim=dim // heads if head_dim is None else head_dim, qk_norm=True,
        mlp_hidden=hub.get("intermediate_size", 22016), max_seq_len=hub.get("max_position_embeddings", 32768),
        rope_theta=_rope_theta(hub, "sdar", 10000.0), layout="block_causal",
        block_size=_block_size(hub, "sdar", block_size, SDAR_BLOCK_SIZE), mask_token_id=mask_token_id,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, norm_eps=float(hub.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hub.get("tie_word_embeddings", False)), qkv_bias=False, shift_logits=False)


def llada2_config(hub: dict, mask_token_id: int, eos_token_id, pad_token_id,
                  block_size: int | None = None) -> TransformerConfig:
    """TransformerConfig of a LLaDA2.0 / 2.1 config.json (configuration_llada2_moe.py's keys and defaults):
    block-causal, blocks of ``block_size`` (None: config.json's ``block_size``, else LLADA2_BLOCK_SIZE), per-head q/k
    norms, partial rotary, experts after the dense layers; a ``num_key_value_heads`` of 0 or null is as many as the
    heads (LLaDA2.1's rule), a ``head_dim`` of null hidden / heads, ``num_experts`` null a dense model."""
    _require(hub, "llada2", _LLADA2_SUPPORTED)
    _rope_scaling(hub, "llada2")
    heads, dim = hub.get("num_attention_heads", 16), hub.get("hidden_size", 1024)
    head_dim = hub.get("head_dim") or dim // heads
    factor = hub.get("partial_rotary_factor", 0.5)
    numeric = isinstance(factor, int | float) and not isinstance(factor, bool)
    rotary_dim = int(head_dim * factor) if numeric else None  # int(): the real rotary init's rounding
    if not numeric or not 0 < factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"native llada2: config.json partial_rotary_factor={factor!r} must give an even number of "
                         f"rotated channels in (0, head_dim={head_dim}], got {rotary_dim}; {_elsewhere('llada2')}")
    n_layers = hub.get("num_hidden_layers", 24)
    return TransformerConfig(
        vocab_size=hub.get("vocab_size", 30592), dim=dim, n_layers=n_layers, n_heads=heads,
        n_kv_heads=hub.get("num_key_value_heads") or heads, head_dim=head_dim, rotary_dim=rotary_dim,
        qk_norm=bool(hub.get("use_qk_norm", True)), mlp_hidden=_llada2_dense_hidden(hub), moe=_llada2_moe(hub),
        max_seq_len=hub.get("max_position_embeddings", 16384), rope_theta=_rope_theta(hub, "llada2", 10000.0),
        layout="block_causal", block_size=_block_size(hub, "llada2", block_size, LLADA2_BLOCK_SIZE),
        mask_token_id=mask_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        norm_eps=float(hub.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hub.get("tie_word_embeddings", False)),
        qkv_bias=False, shift_logits=False)


def _llada2_dense_hidden(hub: dict) -> int | None:
    """The dense layers' SwiGLU width (``intermediate_size``; null in the config class's defaults, needed only when
    some layer is dense)."""
    hidden = hub.get("intermediate_size")
    dense = hub.get("num_experts") is None or hub.get("first_k_dense_replace", 0) > 0
    if hidden is None and dense:
        raise ValueError("native llada2: config.json intermediate_size is null but the dense layers "
                         "(first_k_dense_replace, or num_experts null) need it; fix the config")
    return hidden


def _llada2_moe(hub: dict) -> MoEConfig | None:
    """The experts of a LLaDA2 config.json (None when ``num_experts`` is null: every layer dense)."""
    if hub.get("num_experts", 16) is None:
        return None
    try:
        return MoEConfig(n_experts=hub.get("num_experts", 16), experts_per_token=hub.get("num_experts_per_tok", 2),
                         hidden=hub.get("moe_intermediate_size"), n_shared_experts=hub.get("num_shared_experts") or 0,
                         n_groups=hub.get("n_group", 8), topk_groups=hub.get("topk_group", 4),
                         routed_scaling=hub.get("routed_scaling_factor", 2.5), norm_topk=True,
                         dense_layers=hub.get("first_k_dense_replace", 0))
    except ValueError as error:  # name the hub's keys: moe.n_groups is n_group, moe.hidden moe_intermediate_size, ...
        raise ValueError(f"native llada2: config.json's experts ({_LLADA2_MOE_KEYS}): {error}") from None


_LLADA2_MOE_KEYS = ("num_experts -> n_experts, num_experts_per_tok -> experts_per_token, moe_intermediate_size -> "
                    "hidden, num_shared_experts -> n_shared_experts, n_group -> n_groups, topk_group -> topk_groups, "
                    "routed_scaling_factor -> routed_scaling, first_k_dense_replace -> dense_layers")


# ------------------------------------------------------------------ hub weight names -> ours

# Per-layer tables: hub name after the layer prefix -> (our name after "layers.{i}.", fused slot or None).
# Slots place a hub tensor inside our fused wqkv ([q; k; v] rows) and w13 ([gate; up] rows).
LLADA_LAYER = {
    "attn_norm.weight": ("attn_norm.weight", None),
    "q_proj.weight": ("attn.wqkv.weight", "q"), "k_proj.weight": ("attn.wqkv.weight", "k"),
    "v_proj.weight": ("attn.wqkv.weight", "v"),
    "q_proj.bias": ("attn.wqkv.bias", "q"), "k_proj.bias": ("attn.wqkv.bias", "k"),
    "v_proj.bias": ("attn.wqkv.bias", "v"),
    "attn_out.weight": ("attn.wo.weight", None),
    "ff_norm.weight": ("mlp_norm.weight", None),
    "ff_proj.weight": ("mlp.w13.weight", "gate"), "up_proj.weight": ("mlp.w13.weight", "up"),
    "ff_out.weight": ("mlp.w2.weight", None),
}
LLADA_TOP = {"model.transformer.wte.weight": "tok_embeddings.weight", "model.transformer.ln_f.weight": "norm.weight",
             "model.transformer.ff_out.weight": "output.weight"}
DREAM_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", None),
    "self_attn.q_proj.weight": ("attn.wqkv.weight", "q"), "self_attn.k_proj.weight": ("attn.wqkv.weight", "k"),
    "self_attn.v_proj.weight": ("attn.wqkv.weight", "v"),
    "self_attn.q_proj.bias": ("attn.wqkv.bias", "q"), "self_attn.k_proj.bias": ("attn.wqkv.bias", "k"),
    "self_attn.v_proj.bias": ("attn.wqkv.bias", "v"),
    "self_attn.o_proj.weight": ("attn.wo.weight", None),
    "post_attention_layernorm.weight": ("mlp_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.w13.weight", "gate"), "mlp.up_proj.weight": ("mlp.w13.weight", "up"),
    "mlp.down_proj.weight": ("mlp.w2.weight", None),
}
DREAM_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
# SDAR is Qwen3's layout: Dream's (Qwen2's) names without the q/k/v biases, plus each layer's per-head q/k norms.
SDAR_LAYER = {**{name: row for name, row in DREAM_LAYER.items() if not name.endswith(".bias")},
              "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
              "self_attn.k_norm.weight": ("attn.k_norm.weight", None)}
SDAR_TOP = DREAM_TOP
# LLaDA2: fused q/k/v rows already in our order; "{e}" is an expert's index, its slot places it in the stacked experts
LLADA2_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", None),
    "attention.query_key_value.weight": ("attn.wqkv.weight", None),
    "attention.query_layernorm.weight": ("attn.q_norm.weight", None),
    "attention.key_layernorm.weight": ("attn.k_norm.weight", None),
    "attention.dense.weight": ("attn.wo.weight", None),
    "post_attention_layernorm.weight": ("mlp_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.w13.weight", "gate"), "mlp.up_proj.weight": ("mlp.w13.weight", "up"),
    "mlp.down_proj.weight": ("mlp.w2.weight", None),
    "mlp.gate.weight": ("mlp.router.weight", None), "mlp.gate.expert_bias": ("mlp.expert_bias", None),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared.w13.weight", "gate"),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared.w13.weight", "shared_up"),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared.w2.weight", None),
    "mlp.experts.{e}.gate_proj.weight": ("mlp.experts_w13", "expert_gate"),
    "mlp.experts.{e}.up_proj.weight": ("mlp.experts_w13", "expert_up"),
    "mlp.experts.{e}.down_proj.weight": ("mlp.experts_w2", "expert_down"),
}
LLADA2_TOP = {"model.word_embeddings.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}


@dataclass(frozen=True)
class _Family:
    """One architecture's tables: config mapping, weight names, and its token and block rules."""

    config: Callable[..., TransformerConfig]
    layer_prefix: str
    layer: dict[str, tuple[str, str | None]]
    top: dict[str, str]
    ignored: str  # regex of hub tensors that are computed, not loaded (rotary tables)
    mask_token_names: tuple[str, ...]  # tokens that mean "mask" when neither config.json nor the tokenizer names one
    bpe_tokenizer: str | None = None  # transformers' class for vocab.json + merges.txt when there is no tokenizer.json
    default_mask_token_id: int | None = None  # when nothing names one (what the family's servers hard-code)
    default_eos_token_id: int | None = None  # when neither tokenizer, config.json nor generation_config.json does
    block_causal: bool = False  # config takes block_size= (dllm.load's block_size option)
    block_anchor: str = "answer"  # Capabilities.block_anchor: where the family's blocks start
    run_blocks: bool = False  # Capabilities.run_blocks: the official decoder's block_length sets the attention blocks


_ROTARY = r"(^|\.)rotary_emb\.inv_freq$"
_FAMILIES = {
    "llada": _Family(llada_config, "model.transformer.blocks.", LLADA_LAYER, LLADA_TOP, r"$^",
                     LLaDAAdapter.mask_token_names),
    # Dream's hub tokenizer is its own tokenization_dream.py, Qwen2's byte-level BPE with Qwen2's pre-tokenizer
    # regex: transformers' Qwen2Tokenizer reads the same vocab.json/merges.txt without running that file.
    "dream": _Family(dream_config, "model.layers.", DREAM_LAYER, DREAM_TOP, _ROTARY, DreamAdapter.mask_token_names,
                     "Qwen2Tokenizer"),
    # SDAR's tokenizer is Qwen3's (the same byte-level BPE, class Qwen2Tokenizer).
    "sdar": _Family(sdar_config, "model.layers.", SDAR_LAYER, SDAR_TOP, _ROTARY, ("<|MASK|>", "<MASK>"),
                    "Qwen2Tokenizer", default_mask_token_id=SDAR_MASK_TOKEN_ID, block_causal=True,
                    block_anchor="absolute", run_blocks=True),
    # LLaDA2's tokenizer (Ling's) ships a tokenizer.json
    "llada2": _Family(llada2_config, "model.layers.", LLADA2_LAYER, LLADA2_TOP, _ROTARY, ("<|mask|>",),
                      default_mask_token_id=LLADA2_MASK_TOKEN_ID, default_eos_token_id=LLADA2_EOS_TOKEN_ID,
                      block_causal=True, block_anchor="absolute", run_blocks=True),
}


def weight_renamer(family: str, config: TransformerConfig) -> Callable[[str], Target | None]:
    """The hub-name -> Target function of ``family`` for a model built from ``config`` (KeyError if unknown)."""
    spec = _FAMILIES[family]
    q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    offsets = {None: 0, "q": 0, "k": q_dim, "v": q_dim + kv_dim, "gate": 0, "up": config.mlp_hidden}
    moe, strides = config.moe, {}
    if moe is not None:  # expert e's gate, up and down rows in the stacked experts; the shared experts' up
        hidden = moe.hidden
        offsets.update(shared_up=moe.n_shared_experts * hidden, expert_gate=0, expert_up=hidden, expert_down=0)
        strides = {"expert_gate": 2 * hidden, "expert_up": 2 * hidden, "expert_down": config.dim}
    layer_name = re.compile(re.escape(spec.layer_prefix) + r"(\d+)\.(.+)$")
    expert_name = re.compile(r"(.*\.experts\.)(\d+)(\..+)$")

    def rename(hub_name: str) -> Target | None:
        if re.search(spec.ignored, hub_name):
            return None
        if hub_name in spec.top:
            ours = spec.top[hub_name]
            if ours == "output.weight" and config.tie_embeddings:
                return None  # a tied checkpoint may store the shared matrix twice; ours is the embedding
            return Target(ours)
        match = layer_name.match(hub_name)
        if match is None or int(match.group(1)) >= config.n_layers:
            raise KeyError(hub_name)
        rest, expert = match.group(2), None
        numbered = expert_name.match(rest)
        if numbered is not None:
            rest, expert = f"{numbered.group(1)}{{e}}{numbered.group(3)}", int(numbered.group(2))
        if rest not in spec.layer or (expert is not None and (moe is None or expert >= moe.n_experts)):
            raise KeyError(hub_name)
        ours, slot = spec.layer[rest]
        if ours.endswith("bias") and ours.startswith("attn.") and not config.qkv_bias:
            raise KeyError(hub_name)
        if ours.startswith("mlp.shared.") and moe is not None and not moe.n_shared_experts:
            return None  # num_shared_experts 0: the real code still stores its empty (0-row) shared expert
        offset = offsets[slot] + (expert * strides[slot] if expert is not None else 0)
        return Target(f"layers.{match.group(1)}.{ours}", offset)

    return rename


# ------------------------------------------------------------------ loading


def load_native(name_or_path: str | os.PathLike, family: str, device=None, dtype: torch.dtype | None = None,
                **kw: Any) -> NativeLM:
    """A LLaDA, Dream, SDAR or LLaDA2 checkpoint (local folder or hub id) as a NativeLM with ``.tokenizer``; no hub
    code runs.

    kw: ``device_map`` (accelerate placement across GPUs, instead of ``device``), ``tokenizer`` (object or
    path), ``mask_token_id`` (override), ``block_size`` (block-causal families: override of config.json's, or of
    the family's default); for a hub id, ``revision``, ``token``, ``cache_dir``, ``local_files_only``.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    unknown = sorted(set(kw) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"native {family} loading takes the keywords {list(_OPTIONS)}, got {unknown}")
    spec = _FAMILIES[family]
    block_size = kw.get("block_size")
    if block_size is not None:
        if not spec.block_causal:
            blocky = [name for name, f in _FAMILIES.items() if f.block_causal]
            raise TypeError(f"block_size= is for the block-causal families {blocky}; native {family} attends "
                            f"bidirectionally (a sampler's block_length sets its blocks)")
        check_int("block_size", block_size, 1)
    device_map = kw.get("device_map")
    if device == "auto":  # dllm.load's device="auto" means accelerate's placement, as in from_pretrained
        device, device_map = None, "auto"
    folder = _folder(name_or_path, kw)
    hub = json.loads((folder / "config.json").read_text())
    tokenizer = _tokenizer(kw.get("tokenizer"), folder, spec.bpe_tokenizer)
    namespace = types.SimpleNamespace(**hub)  # the attribute view the adapters' id helpers read
    mask_token_id = _mask_token_id(kw.get("mask_token_id"), family, folder, namespace, tokenizer)
    eos, pad, stops = special_ids(namespace, tokenizer)
    if eos is None:
        eos = _fallback_eos(family, folder, hub.get("vocab_size"))
        stops = tuple(dict.fromkeys(i for i in (eos, *stops) if i is not None))
    blocks = {"block_size": block_size} if spec.block_causal else {}
    config = spec.config(hub, mask_token_id, eos, pad, **blocks)
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = NativeLM(config, family)
    if config.tie_embeddings:  # accelerate re-wraps each parameter inside init_empty_weights, which unties them
        model.output.weight = model.tok_embeddings.weight
    load_checkpoint(model, folder, weight_renamer(family, config), dtype=dtype, device=device,
                    device_map=device_map)
    model.requires_grad_(False).eval()
    model.tokenizer, model.stop_token_ids = tokenizer, stops
    return model


def _fallback_eos(family: str, folder: Path, vocab_size: int | None) -> int | None:
    """The EOS id when neither the tokenizer nor config.json names one: generation_config.json's, else the family's
    default where the vocabulary holds it, else None."""
    generation = folder / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    default = _FAMILIES[family].default_eos_token_id
    return default if default is not None and (vocab_size is None or default < vocab_size) else None


def _mask_token_id(given: int | None, family: str, folder: Path, config, tokenizer) -> int:
    """``given``, else the id config.json or the tokenizer names (``find_mask_token_id``), else the family's
    default when it has one and the vocabulary holds it; a ValueError naming mask_token_id= otherwise."""
    spec = _FAMILIES[family]
    if given is not None:
        return given
    found = find_mask_token_id(config, tokenizer, spec.mask_token_names)
    if found is not None:
        return found
    default, vocab_size = spec.default_mask_token_id, getattr(config, "vocab_size", None)
    if default is not None and (vocab_size is None or default < vocab_size):
        return default
    named = f"config.json mask_token_id, the tokenizer's mask_token, or one of {list(spec.mask_token_names)}"
    unusable = (f"; the family's default {default} is outside its vocab_size={vocab_size}"
                if default is not None else "")
    raise ValueError(f"native {family}: {folder} names no mask token ({named}){unusable}; "
                     "pass mask_token_id= to dllm.load")


def _folder(name_or_path, kw: dict) -> Path:
    """The local folder, or a hub snapshot of its config, weight and tokenizer files only (no ``.py``)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    hub = {k: kw[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kw}
    return Path(snapshot_download(str(name_or_path), allow_patterns=HUB_PATTERNS, ignore_patterns=["*.py"], **hub))


def _tokenizer(given, folder: Path, bpe_class: str | None):
    """``given`` if it is a tokenizer; else the fast tokenizer of ``given`` or the folder (tokenizer.json, or
    vocab.json + merges.txt read by ``bpe_class``; no remote code); None when it has neither."""
    if given is not None and not isinstance(given, str | os.PathLike):
        return given
    source = Path(given) if given is not None else folder
    if source.is_dir() and not (source / "tokenizer.json").is_file():
        if bpe_class is None or not all((source / f).is_file() for f in ("vocab.json", "merges.txt")):
            return None
        import transformers

        return getattr(transformers, bpe_class).from_pretrained(str(source), local_files_only=True)
    from transformers import PreTrainedTokenizerFast

    if source.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(source))
    return PreTrainedTokenizerFast.from_pretrained(str(source), local_files_only=True)
