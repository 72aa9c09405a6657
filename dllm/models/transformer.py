"""The project's small transformer LM: RMSNorm, rotary positions, SwiGLU MLP, SDPA attention.

One module, three attention layouts chosen by ``TransformerConfig.layout``:
  - ``causal``: an autoregressive LM; ``logits[:, i]`` predicts token i+1.
  - ``bidirectional``: a masked diffusion LM (LLaDA-like); ``logits[:, i]`` predicts the clean token at i.
  - ``block_causal``: block diffusion; bidirectional inside blocks of ``block_size`` positions, causal
    across blocks (a query in block b sees keys in blocks <= b); ``logits[:, i]`` predicts token i.

Two optional parts for hub architectures (both off by default): partial rotary (``rotary_dim``: only the first
channels of each head rotate, LLaDA2's ``partial_rotary_factor``) and a mixture-of-experts MLP (``moe``:
``MoEConfig``, DeepSeek-V3-style routing as LLaDA2 / Ling use it).

Mask convention everywhere: boolean, True = may attend (as in ``F.scaled_dot_product_attention``).
Layout masks are built from position ids, so left padding moves block boundaries with the real tokens,
and ``block_offset`` aligns blocks to e.g. the start of a generated answer; ``block_size=`` on a call replaces the
config's block size for that call (a run's blocks, where they are the run's choice: ``Capabilities.run_blocks``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from safetensors.torch import save_file
from torch import Tensor, nn

from dllm.models.cache import KVCache
from dllm.numerics import positions_from_mask
from dllm.protocols import Capabilities, gather_positions, sampler_defaults_record

LAYOUTS = ("causal", "bidirectional", "block_causal")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DEFAULTS_NAME = "sampler_defaults.json"  # optional: the settings measured fastest on the checkpoint


def _check_positive_int(name: str, value: Any) -> None:
    """Raise a ValueError naming ``name`` unless value is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    """Raise a ValueError naming ``name`` unless value is None or an id in [0, vocab_size)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be None or an int in [0, vocab_size={vocab_size}), got {value!r}")


SCORE_FUNCTIONS = ("sigmoid",)  # router score functions MoEConfig implements


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP in place of the SwiGLU (DeepSeek-V3's routing, as LLaDA2 / Ling use it).

    Each token's router scores ``score(x W_router)`` (float32) plus a per-expert bias choose its
    ``experts_per_token`` experts, only among the ``topk_groups`` best of ``n_groups`` equal groups of experts (a
    group ranked by the sum of its two best biased scores); the chosen experts' *unbiased* scores, renormalised to
    sum to 1 (``norm_topk``, when more than one expert is chosen) and times ``routed_scaling``, weight their SwiGLU
    outputs (the bias steers the choice only: auxiliary-loss-free load balancing). ``n_shared_experts`` always-on
    experts run as one SwiGLU of ``n_shared_experts * hidden``. The first ``dense_layers`` layers keep the dense
    SwiGLU of ``TransformerConfig.mlp_hidden`` (LLaDA2's ``first_k_dense_replace``).
    """

    n_experts: int
    experts_per_token: int
    hidden: int  # each routed expert's SwiGLU width (LLaDA2's moe_intermediate_size)
    n_shared_experts: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    norm_topk: bool = True
    score: str = "sigmoid"  # one of SCORE_FUNCTIONS
    dense_layers: int = 0

    def __post_init__(self):
        for name in ("n_experts", "experts_per_token", "hidden", "n_groups", "topk_groups"):
            _check_positive_int(f"moe.{name}", getattr(self, name))
        for name in ("n_shared_experts", "dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"moe.{name} must be an int >= 0, got {value!r}")
        if self.n_experts % self.n_groups:
            raise ValueError(f"moe.n_groups ({self.n_groups}) must divide moe.n_experts ({self.n_experts})")
        if self.n_groups > 1 and self.n_experts // self.n_groups < 2:
            raise ValueError(f"moe.n_groups ({self.n_groups}) leaves fewer than 2 experts per group (a group is "
                             f"ranked by its two best scores)")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"moe.topk_groups ({self.topk_groups}) must be <= moe.n_groups ({self.n_groups})")
        reachable = self.topk_groups * (self.n_experts // self.n_groups)
        if self.experts_per_token > reachable:
            raise ValueError(f"moe.experts_per_token ({self.experts_per_token}) must be <= the experts of the "
                             f"moe.topk_groups best groups ({reachable})")
        value = self.routed_scaling
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"moe.routed_scaling must be a positive number, got {value!r}")
        if not isinstance(self.norm_topk, bool):
            raise ValueError(f"moe.norm_topk must be a bool, got {self.norm_topk!r}")
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"moe.score must be one of {SCORE_FUNCTIONS}, got {self.score!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MoEConfig:
        """Build from a dict, rejecting keys that are not fields."""
        return _from_fields(cls, values)


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture and special token ids of a TransformerLM (validated on construction)."""

    vocab_size: int
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads; fewer gives grouped-query attention
    mlp_hidden: int | None = None  # None -> 8/3 * dim rounded up to 64: SwiGLU at ~ the params of a 4x MLP
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    layout: str = "causal"  # one of LAYOUTS
    block_size: int | None = None  # required for, and only allowed with, layout="block_causal"
    mask_token_id: int | None = None  # required for diffusion layouts, None for causal
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-style checkpoints such as Dream)
    shift_logits: bool = False  # logits at position p read the last-layer state at p - 1 (Dream's AR init)
    head_dim: int | None = None  # None -> dim // n_heads; Qwen3-style checkpoints (SDAR) may set another width
    qk_norm: bool = False  # RMSNorm of each query and key head over head_dim before rotary (Qwen3's q_norm / k_norm)
    rotary_dim: int | None = None  # None -> head_dim; fewer: only each head's first rotary_dim channels rotate (LLaDA2)
    moe: MoEConfig | None = None  # experts in place of the SwiGLU after moe.dense_layers layers (LLaDA2); or its dict

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        self._check_heads()
        self._check_moe()
        self._check_layout()
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            _check_token_id(name, getattr(self, name), self.vocab_size)
        if self.mlp_hidden is None:
            object.__setattr__(self, "mlp_hidden", math.ceil(8 * self.dim / 3 / 64) * 64)
        _check_positive_int("mlp_hidden", self.mlp_hidden)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("tie_embeddings", "qkv_bias", "shift_logits", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.shift_logits and self.layout == "causal":
            raise ValueError("shift_logits is for diffusion layouts; a causal layout already scores the next token")

    def _check_heads(self) -> None:
        """Head counts divide evenly and head_dim is even (rotary rotates pairs); head_dim None is dim / n_heads,
        an explicit one may differ (Qwen3-style attention projects dim to n_heads x head_dim and back)."""
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) when head_dim is "
                                 f"None (derived as dim / n_heads)")
            if (self.dim // self.n_heads) % 2:
                raise ValueError(f"head_dim = dim / n_heads = {self.dim // self.n_heads} must be even for rotary")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary, got {self.head_dim}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        _check_positive_int("rotary_dim", self.rotary_dim)
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({self.head_dim}), got {self.rotary_dim}")

    def _check_moe(self) -> None:
        """``moe`` is None or a MoEConfig (a dict, as config.json holds it, is read into one) whose dense layers
        fit in n_layers."""
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig.from_dict(self.moe))
        if self.moe is None:
            return
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe must be None, a MoEConfig or its dict, got {self.moe!r}")
        if self.moe.dense_layers > self.n_layers:
            raise ValueError(f"moe.dense_layers ({self.moe.dense_layers}) must be <= n_layers ({self.n_layers})")

    def _check_layout(self) -> None:
        """Layout is known and carries the fields it needs (block_size, mask_token_id)."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "block_causal":
            _check_positive_int("block_size", self.block_size)
        elif self.block_size is not None:
            raise ValueError(f"block_size is only for layout='block_causal', got layout={self.layout!r}")
        if self.layout == "causal" and self.mask_token_id is not None:
            raise ValueError("mask_token_id must be None for layout='causal' (an AR model has no mask token)")
        if self.layout != "causal" and self.mask_token_id is None:
            raise ValueError(f"mask_token_id is required for layout={self.layout!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (defaults resolved), JSON-serialisable."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        """Build from a dict, rejecting keys that are not fields (typos must not pass silently)."""
        return _from_fields(cls, values)


def _from_fields(cls, values: dict[str, Any]):
    """``cls(**values)`` for a config dataclass, or a ValueError naming the keys that are not its fields."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {unknown}; allowed keys: {fields}")
    return cls(**values)


class _Blocks(NamedTuple):
    """A call's block-causal layout: blocks of ``size`` positions starting at ``offset + k * size``."""

    size: int | None
    offset: int | Tensor  # int or [B]


def layout_mask(
    layout: str,
    query_pos: Tensor,  # [B, Lq]
    key_pos: Tensor,  # [B, Lk]
    block_size: int | None = None,
    block_offset: int | Tensor = 0,  # int or [B]
) -> Tensor:
    """Which keys each query may attend to under a layout, from positions (True = attend).  # [B, Lq, Lk]

    Blocks start at positions ``block_offset + k * block_size`` (k may be negative, so a prompt before
    the offset is split into blocks aligned to it).
    """
    query = rearrange(query_pos, "b q -> b q 1")
    key = rearrange(key_pos, "b k -> b 1 k")
    if layout == "bidirectional":
        return torch.ones(query.shape[0], query.shape[1], key.shape[2], dtype=torch.bool, device=key.device)
    if layout == "causal":
        return key <= query
    if layout != "block_causal":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    offset = torch.as_tensor(block_offset, device=key.device).reshape(-1, 1, 1)
    key_block = torch.div(key - offset, block_size, rounding_mode="floor")
    query_block = torch.div(query - offset, block_size, rounding_mode="floor")
    return key_block <= query_block


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + R/2) of the first R = 2 * cos.shape[-1] channels by position angles, in float32;
    channels past R pass unrotated (partial rotary: LLaDA2 rotate-halves the first half of each head, as
    transformers' ``apply_rotary_pos_emb`` with a narrower cos).  # x [B, H, L, D]; cos [B, L, R/2]"""
    cos, sin = rearrange(cos, "b l d -> b 1 l d"), rearrange(sin, "b l d -> b 1 l d")
    width = 2 * cos.shape[-1]
    x32 = x.float()
    first, second = x32[..., :width].chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    if width < x.shape[-1]:
        rotated = torch.cat((rotated, x32[..., width:]), dim=-1)
    return rotated.to(x.dtype)


class _Rotary(nn.Module):
    """Precomputed float32 cos/sin tables for positions [0, max_seq_len), indexed by position ids."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self._build(device=None)

    def init_buffers(self, device: torch.device | None) -> None:
        """Compute the tables on ``device`` (they are never stored in a checkpoint)."""
        self._build(device)

    def _build(self, device: torch.device | None) -> None:
        """(Re)compute the tables in float64 then store float32 (angles at large positions need the bits)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(positions, self.theta**-exponents)  # [max_seq_len, D/2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the tables too; rebuild them in float32 on the new device.
        super()._apply(fn, recurse)
        self._build(self.cos.device)
        return self

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin at each position.  # position_ids [B, L] -> ([B, L, D/2], [B, L, D/2])"""
        return self.cos[position_ids], self.sin[position_ids]


class _RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 for bf16 stability."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # [..., dim] -> [..., dim]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class _Attention(nn.Module):
    """Multi-head (optionally grouped-query) attention with rotary positions and a boolean mask; with
    ``qk_norm`` each query and key head is RMS-normed over head_dim before rotary (Qwen3, SDAR)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wqkv = nn.Linear(config.dim, q_dim + 2 * kv_dim, bias=config.qkv_bias)  # one matmul for q, k, v
        self.wo = nn.Linear(q_dim, config.dim, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # one gain per head channel, shared by the heads
            self.q_norm = _RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = _RMSNorm(self.head_dim, config.norm_eps)

    def forward(
        self,
        x: Tensor,  # [B, L, dim]
        cos: Tensor,  # [B, L, R/2], R = rotary_dim
        sin: Tensor,  # [B, L, R/2]
        mask: Tensor,  # [B, 1, L, P + L] bool
        past: tuple[Tensor, Tensor] | None,  # cached ([B, H_kv, P, D], [B, H_kv, P, D])
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attention output [B, L, dim] and this call's keys/values [B, H_kv, L, D] for a cache."""
        out, new_k, new_v = self.attend(self.wqkv(x), cos, sin, mask, past)
        return self.wo(out), new_k, new_v

    def attend(self, qkv: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
               past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """``forward`` between the two projections: the heads' outputs [B, L, H * D] of the projected q/k/v
        [B, L, (H + 2 H_kv) * D], and this call's keys/values (``forward_many`` projects many calls at once)."""
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([self.n_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        q = rearrange(q, "b l (h d) -> b h l d", d=self.head_dim)
        k = rearrange(k, "b l (h d) -> b h l d", d=self.head_dim)
        if self.qk_norm:  # per head, before the rotation (as Qwen3's attention)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        v = rearrange(v, "b l (h d) -> b h l d", d=self.head_dim)
        new_k, new_v = k, v
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        if self.n_kv_heads != self.n_heads:  # query head j reads kv head j // groups
            groups = self.n_heads // self.n_kv_heads
            k = repeat(k, "b h l d -> b (h g) l d", g=groups)
            v = repeat(v, "b h l d -> b (h g) l d", g=groups)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return rearrange(out, "b h l d -> b l (h d)"), new_k, new_v


class _SwiGLU(nn.Module):
    """Gated MLP: w2(silu(x w1) * (x w3)), with w1 and w3 fused into one matmul."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [B, L, dim] -> [B, L, dim]
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class _MoE(nn.Module):
    """Routed experts plus shared ones (``MoEConfig``), computed as LLaDA2's ``LLaDA2MoeSparseMoeBlock`` does.

    The experts' weights are stacked, expert e's rows at e's offset (what a hub checkpoint's per-expert tensors
    fill): ``experts_w13`` [E * 2H, dim] (gate then up), ``experts_w2`` [E * dim, H]. The (token, expert) pairs are
    sorted by expert and each projection is one grouped matmul over all pairs (``_grouped_linear``).
    """

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.moe, self.dim = moe, dim
        self.router = nn.Linear(dim, moe.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts))  # steers the choice only
        self.experts_w13 = nn.Parameter(torch.empty(moe.n_experts * 2 * moe.hidden, dim))
        self.experts_w2 = nn.Parameter(torch.empty(moe.n_experts * dim, moe.hidden))
        self.shared = _SwiGLU(dim, moe.n_shared_experts * moe.hidden) if moe.n_shared_experts else None

    def init_buffers(self, device: torch.device | None) -> None:
        """A checkpoint without a router bias routes on the scores alone (the real code's zero buffer): zeros where
        the buffer was never filled, moved to ``device`` where it was made outside the meta device."""
        if self.expert_bias.is_meta:
            self.expert_bias = torch.zeros(self.moe.n_experts, device=device)
        elif device is not None:
            self.expert_bias = self.expert_bias.to(device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts and their weights, in float32.  # x [T, dim] -> ([T, k] long, [T, k] float32)"""
        moe = self.moe
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.expert_bias.float()
        if moe.topk_groups < moe.n_groups:  # only experts of the topk_groups best groups stay eligible
            grouped = rearrange(choice, "t (g e) -> t g e", g=moe.n_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            best = group_scores.topk(moe.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = rearrange(grouped.masked_fill(~keep[..., None], float("-inf")), "t g e -> t (g e)")
        experts = choice.topk(moe.experts_per_token, dim=-1).indices
        weights = scores.gather(1, experts)
        if moe.norm_topk and moe.experts_per_token > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # the real code's epsilon
        return experts, weights * moe.routed_scaling

    def forward(self, x: Tensor) -> Tensor:  # [B, L, dim] -> [B, L, dim]
        flat = rearrange(x, "b l d -> (b l) d")
        experts, weights = self.route(flat)
        out = rearrange(self._routed(flat, experts, weights), "(b l) d -> b l d", b=x.shape[0])
        return out if self.shared is None else out + self.shared(x)

    def _routed(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """Sum over each token's experts of weight x SwiGLU_e(x).  # x [T, dim], experts/weights [T, k] -> [T, dim]"""
        moe, k = self.moe, experts.shape[1]
        order = experts.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(experts.flatten(), minlength=moe.n_experts)  # [E]
        pairs = x[order // k]  # [T * k, dim]
        w13 = self.experts_w13.view(moe.n_experts, 2 * moe.hidden, self.dim)
        gate, up = _grouped_linear(pairs, w13, counts).chunk(2, dim=-1)
        w2 = self.experts_w2.view(moe.n_experts, self.dim, moe.hidden)
        done = _grouped_linear(F.silu(gate) * up, w2, counts)  # [T * k, dim], sorted by expert
        out = torch.empty_like(done)
        out[order] = done
        # weighted in float32 and summed per token (as the real moe_infer): no atomic adds, same on every run
        return (rearrange(out, "(t k) d -> t k d", k=k).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def _grouped_linear(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for expert e, in order) times ``weight[e]``^T.

    # x [N, K], weight [E, M, K], counts [E] -> [N, M]
    One grouped matmul (``F.grouped_mm``: every expert in one call, the counts never read on the host) where torch
    has it for the operands (``_grouped_mm_ok``); else one matmul per expert that received rows, the counts read
    once on the host (a sync per MoE layer on a GPU). Why not one ``bmm`` over each (token, expert) pair with its
    expert's weights gathered: it copies an expert's weights once per pair. Measured on 2 CPU cores at LLaDA2-mini's
    layer (dim 2048, 256 experts of 512, top 8, float32): 8 tokens 31 ms grouped, 29 ms per expert, 355 ms gathered;
    64 tokens 134, 129 and 4219 ms; 256 tokens 276 and 296 ms (gathered: 17 GB, not run). On the CPU grouped_mm is
    a loop of matmuls itself, so the two paths cost the same; it is kept for the missing host read.
    """
    if _grouped_mm_ok(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    parts = x.split(counts.tolist())
    return torch.cat([part @ weight[e].T for e, part in enumerate(parts) if part.shape[0]]
                     or [x.new_empty(0, weight.shape[1])])


def _grouped_mm_ok(x: Tensor, weight: Tensor) -> bool:
    """Whether ``F.grouped_mm`` (torch >= 2.9) serves these operands: rows a multiple of 16 bytes wide (its kernels'
    stride rule, on the CPU too); on CUDA bfloat16 at compute capability >= 8.0; on the CPU whatever a one-time trial
    in that dtype runs."""
    if getattr(F, "grouped_mm", None) is None or (x.shape[-1] * x.element_size()) % 16 \
            or (weight.shape[1] * weight.element_size()) % 16:
        return False
    if x.device.type == "cpu":
        return _cpu_grouped_mm(x.dtype)
    return (x.device.type == "cuda" and x.dtype == weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


@functools.cache
def _cpu_grouped_mm(dtype: torch.dtype) -> bool:
    """One small grouped matmul on the CPU in ``dtype``, checked against its known result (torch versions differ)."""
    x, weight = torch.ones(3, 8, dtype=dtype), torch.ones(2, 8, 8, dtype=dtype)
    try:
        out = F.grouped_mm(x, weight.transpose(-2, -1), offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return out.shape == (3, 8) and bool((out == 8).all())


class _Block(nn.Module):
    """Pre-norm residual block: attention then SwiGLU (or, with ``config.moe`` past its dense layers, experts)."""

    def __init__(self, config: TransformerConfig, index: int = 0):
        super().__init__()
        self.attn_norm = _RMSNorm(config.dim, config.norm_eps)
        self.attn = _Attention(config)
        self.mlp_norm = _RMSNorm(config.dim, config.norm_eps)
        moe = config.moe
        self.mlp = _MoE(config.dim, moe) if moe is not None and index >= moe.dense_layers \
            else _SwiGLU(config.dim, config.mlp_hidden)

    def forward(self, x, cos, sin, mask, past, keep: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Same arguments as _Attention.forward; returns (x [B, L, dim], k, v), k and v None unless ``keep`` (v
        views the whole q/k/v projection: dropped before the MLP, the layer's peak is smaller)."""
        attended, k, v = self.attn(self.attn_norm(x), cos, sin, mask, past)
        if not keep:
            k = v = None
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), k, v


def _query_mask(attention_mask: Tensor | None, input_ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """Split ``attention_mask`` into (real-token flags [B, L], explicit mask [B|1, L, Lk] or None)."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool), None
    if attention_mask.dim() == 2:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"2-D attention_mask must match input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        return attention_mask.bool(), None
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"3-D/4-D attention_mask must be bool (True = attend), got {attention_mask.dtype}")
    if attention_mask.dim() == 4:
        if attention_mask.shape[1] != 1:
            raise ValueError(f"4-D attention_mask must be [B, 1, Lq, Lk], got {tuple(attention_mask.shape)}")
        attention_mask = attention_mask[:, 0]
    if attention_mask.dim() != 3:
        raise ValueError(f"attention_mask must be [B, L], [B, Lq, Lk] or [B, 1, Lq, Lk], "
                         f"got {tuple(attention_mask.shape)}")
    return torch.ones_like(input_ids, dtype=torch.bool), attention_mask


def _never_empty(mask: Tensor, n_past: int) -> Tensor:
    """Let a query that sees no key see itself, so padding rows give finite (unused) values.  # [B, Lq, Lk]"""
    n_query, n_key = mask.shape[-2:]
    query_index = torch.arange(n_query, device=mask.device)[:, None] + n_past
    diagonal = torch.arange(n_key, device=mask.device)[None, :] == query_index
    return mask | (diagonal & ~mask.any(dim=-1, keepdim=True))


def _structured_mask(positions: Tensor, count: Tensor, bonus: Tensor, length: int, width: int) -> Tensor:
    """Who sees whom in ``structured_verify``: state, drafts, window queries, bonus query.  # [R, Lq, Lq]"""
    n = positions.shape[0]
    device = positions.device
    big = width + 1
    # slot[k]: the window index j whose position is state position k (big when k is in no window slot).
    j = torch.arange(width, device=device)
    live = j[None, :] < count[:, None]  # [R, W]
    match = (positions[:, :, None] == torch.arange(length, device=device)) & live[:, :, None]  # [R, W, L]
    slot = torch.where(match.any(dim=1), match.long().argmax(dim=1), big)  # [R, L]
    is_bonus = torch.arange(length, device=device)[None, :] == bonus[:, None]  # [R, L]
    i = j
    # Rows of each block: state queries (L), draft queries (W), window queries (W), the bonus query (1).
    state_to_state = torch.ones(n, length, length, dtype=torch.bool, device=device)
    draft_to_state = slot[:, None, :] > i[None, :, None]  # draft i: state minus s_0..s_i
    query_to_state = slot[:, None, :] > i[None, :, None]  # window query j: state minus s_0..s_j
    bonus_to_state = ((slot >= big) & ~is_bonus)[:, None, :]
    lower = i[:, None] >= i[None, :]  # [W, W]: draft i sees drafts i' <= i
    draft_live = live[:, None, :]
    draft_to_draft = lower[None] & draft_live
    query_to_draft = (i[:, None] > i[None, :])[None] & draft_live  # window query j sees drafts i' < j
    bonus_to_draft = draft_live[:, :1, :].expand(n, 1, width)
    eye = torch.eye(width, dtype=torch.bool, device=device).expand(n, width, width)
    none_w = torch.zeros(n, width, width, dtype=torch.bool, device=device)
    rows = [
        torch.cat([state_to_state, _zeros(n, length, 2 * width + 1, device=device)], 2),
        torch.cat([draft_to_state, draft_to_draft, none_w, _zeros(n, width, 1, device=device)], 2),
        torch.cat([query_to_state, query_to_draft, eye, _zeros(n, width, 1, device=device)], 2),
        torch.cat([bonus_to_state, bonus_to_draft, _zeros(n, 1, width, device=device),
                   torch.ones(n, 1, 1, dtype=torch.bool, device=device)], 2),
    ]
    return torch.cat(rows, dim=1)


def _shift_queries(tokens, pos, structure, positions, count, bonus, length: int, cached: bool):
    """``structured_verify``'s queries for a ``shift_logits`` model: the query scoring position s reads the
    state at s - 1, so it becomes the token copy j holds at s - 1 (a draft d_i with i < j, else the state's
    token), at that position, seeing what copy j sees except the key it replaces.
    -> (tokens [R, Lq], pos [R, Lq], structure [R, Lq, Lq])"""
    n, width = positions.shape
    device = positions.device
    targets = torch.cat([positions, bonus.clamp(min=0)[:, None]], dim=1)  # [R, W + 1] scored indices
    prev = targets - 1
    if cached and bool((prev < 0).any()):
        raise ValueError("structured_verify with a cache: a shifted model needs window positions after the first "
                         "input (the state at s - 1 would be in the cache)")
    has_prev = (prev >= 0)[:, :, None]  # at index 0 the state scores itself, as in forward
    prev = prev.clamp(min=0)
    q = torch.arange(width + 1, device=device)
    i = torch.arange(width, device=device)
    live = i[None, :] < count[:, None]  # [R, W]
    seen = (i[None, :] < q[:, None])[None] & live[:, None, :]  # [R, W + 1, W]: query q sees drafts i < q
    at_prev = seen & (positions[:, None, :] == prev[:, :, None])  # the draft copy q holds at s - 1
    drafts = tokens[:, length : length + width]
    token = torch.where(at_prev.any(-1), drafts.gather(1, at_prev.long().argmax(-1)), tokens.gather(1, prev))
    query = slice(length + width, length + 2 * width + 1)
    tokens, pos, structure = tokens.clone(), pos.clone(), structure.clone()
    tokens[:, query] = torch.where(has_prev[..., 0], token, tokens[:, query])
    pos[:, query] = torch.where(has_prev[..., 0], pos[:, :length].gather(1, prev), pos[:, query])
    k = torch.arange(length, device=device)
    match = (positions[:, :, None] == k) & live[:, :, None]  # [R, W, L]
    slot = torch.where(match.any(dim=1), match.long().argmax(dim=1), width + 1)  # [R, L], as _structured_mask
    to_state = (slot[:, None, :] >= q[None, :, None]) & (k[None, None, :] != prev[:, :, None])
    to_draft = seen & ~at_prev
    rows = structure[:, query]
    rows[:, :, :length] = torch.where(has_prev, to_state, rows[:, :, :length])
    rows[:, :, length : length + width] = torch.where(has_prev, to_draft, rows[:, :, length : length + width])
    structure[:, query] = rows
    return tokens, pos, structure


def _previous_states(h: Tensor, positions: Tensor, valid: Tensor, cache: KVCache | None) -> Tensor:
    """Each input's state replaced by that of the valid token one position before it, cached or new (its own
    when there is none: position 0 keeps raw[:, 0], as Dream's shift does).  # h [B, L, dim] -> [B, L, dim]"""
    cached = cache is not None and bool(cache.length)
    if not cached and bool(valid.all()) and bool((positions[:, 1:] - positions[:, :-1] == 1).all()):
        return torch.cat((h[:, :1], h[:, :-1]), dim=1)  # the common unpadded call: a plain shift, no [B, L, L] match
    key_h, key_pos, key_valid, past = h, positions, valid, 0
    if cached:
        if cache.hidden is None:
            raise ValueError("a shift_logits model needs a cache filled by itself (its hidden states are missing)")
        past = cache.length
        key_h = torch.cat((cache.hidden, h), dim=1)
        key_pos = torch.cat((cache.positions, positions), dim=1)
        key_valid = torch.cat((cache.valid, valid), dim=1)
    match = (key_pos[:, None, :] == positions[:, :, None] - 1) & key_valid[:, None, :]  # [B, L, K]
    index = torch.arange(1, key_pos.shape[1] + 1, device=h.device)
    last = (match.long() * index).amax(dim=-1) - 1  # -1: no predecessor
    own = past + torch.arange(h.shape[1], device=h.device)
    pick = torch.where(last >= 0, last, own[None, :])
    return key_h.gather(1, repeat(pick, "b l -> b l d", d=h.shape[-1]))


def _zeros(*shape: int, device=None) -> Tensor:
    return torch.zeros(shape, dtype=torch.bool, device=device)


def _commit_rows(main: KVCache, used: KVCache, rows: Tensor, commit: int) -> None:
    """Append to ``main`` the first ``commit`` new entries of each cache row's first input in ``used``.

    Rows of ``main`` that served no input get invalid entries, so every row keeps the same length.
    """
    start = main.length
    batch = main.batch_size
    first = torch.full((batch,), -1, dtype=torch.long, device=rows.device)
    order = torch.arange(len(rows), device=rows.device)
    first.scatter_reduce_(0, rows, order, reduce="amin", include_self=False)
    served = first >= 0
    pick = first.clamp(min=0)
    span = slice(start, start + commit)
    kv = [(k[pick, :, span], v[pick, :, span]) for k, v in zip(used.keys, used.values)]
    positions = used.positions[pick, span]
    valid = used.valid[pick, span] & served[:, None]
    main.append(kv, positions, valid, None if used.hidden is None else used.hidden[pick, span])


def _run_stages(stages, layers):
    """A forward written as stages (``TransformerLM._stages``) run alone: its layers by ``layers(*arguments)``."""
    return _finish_stages([stages], [layers(*next(stages))])[0]


def _finish_stages(stages: list, layer_answers: list) -> list:
    """Send each forward's stages its layers' answer -> the forwards' answers."""
    outs = []
    for stage, answer in zip(stages, layer_answers, strict=True):
        try:
            stage.send(answer)
        except StopIteration as done:
            outs.append(done.value)
        else:
            raise RuntimeError("a forward's stages yield once")
    return outs


class TransformerLM(nn.Module):
    """Tokens in, logits out: ``model(input_ids [B, L]) -> logits [B, L, V]`` (float32).

    Logits are cast to float32 after the output projection, which runs in the model's dtype (a float32
    projection would dominate a small bf16 model's time). Diffusion layouts set the mask token's logit
    to -inf, so no sampler can emit it.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layout = config.layout
        self.vocab_size = config.vocab_size
        if config.layout != "causal":  # only diffusion models carry a mask token (protocol by attribute)
            self.mask_token_id = config.mask_token_id
        if config.layout == "block_causal":  # samplers then pass block_offset (see dllm.protocols)
            self.block_size = config.block_size
        self.eos_token_id, self.pad_token_id = config.eos_token_id, config.pad_token_id
        # {sampler: {option: value, "when": {...}}} measured fastest on this checkpoint (its sampler_defaults.json;
        # Capabilities.sampler_defaults), applied where the caller sets nothing
        self.sampler_defaults: dict[str, dict] = {}
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(_Block(config, index) for index in range(config.n_layers))
        self.norm = _RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.rotary = _Rotary(config.rotary_dim, config.max_seq_len, config.rope_theta)
        self._init_weights()
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _init_weights(self) -> None:
        """Normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 n_layers) (GPT-2)."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / (2 * self.config.n_layers) ** 0.5
        for layer in self.layers:
            nn.init.normal_(layer.attn.wo.weight, std=residual_std)
            mlp = layer.mlp
            if isinstance(mlp, _MoE):
                nn.init.normal_(mlp.experts_w13, std=0.02)
                nn.init.normal_(mlp.experts_w2, std=residual_std)
                mlp = mlp.shared
            if mlp is not None:
                nn.init.normal_(mlp.w2.weight, std=residual_std)

    def param_count(self) -> int:
        """Number of parameters (tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def context_length(self) -> int:
        """Positions the rotary tables cover: prompt + new tokens may not exceed it (dllm.protocols)."""
        return self.config.max_seq_len

    accepts_attention_mask = True  # an instance may turn it off (as remote code that ignores the mask would)
    padding_note: str | None = None  # and say why

    @property
    def capabilities(self) -> Capabilities:
        """The record samplers read (dllm.protocols): padding, blocks, the KV cache, one-pass verify."""
        # commits_prefix: forward_cached(..., rows=, commit=n) folds a cache fill into a copies call.
        return Capabilities(accepts_attention_mask=bool(self.accepts_attention_mask), padding_note=self.padding_note,
                            context_length=self.context_length,
                            block_size=self.config.block_size, cache=True, cache_exact=self.cache_exact,
                            cache_crop=True, cache_drop=True, commits_prefix=True, structured_verify=True,
                            hidden_states=True, tree_attention=self.layout == "causal", logits_at=True,
                            packs_copies=not self.config.shift_logits,
                            sampler_defaults=sampler_defaults_record(self.sampler_defaults, DEFAULTS_NAME))

    @property
    def cache_exact(self) -> bool:
        """Cached logits equal uncached ones unless attention is bidirectional (then a cache is approximate)."""
        return self.layout != "bidirectional"

    def new_cache(self) -> KVCache:
        """An empty cache for ``forward(..., cache=cache, use_cache=True)``."""
        return KVCache()

    def forward_cached(
        self,
        input_ids: Tensor,  # [N, n]
        cache: KVCache,
        *,
        rows: Tensor | None = None,  # [N] cache row serving each input (copies may share one)
        append: bool = True,
        attention_mask: Tensor | None = None,  # [N, cache.length + n] 0/1 over cached + new keys
        block_offset: int | Tensor = 0,
        block_size: int | None = None,  # the call's attention blocks (as ``forward``)
        position_ids: Tensor | None = None,  # [N, n]; default: continue after the cache
        commit: int = 0,
        return_hidden: bool = False,
        tree_mask: Tensor | None = None,  # [N, n, n] bool: which new tokens each new token sees (as ``forward``)
        logits_at: Tensor | None = None,  # [N, K] input positions whose logits are wanted (as ``forward``)
        segments: Tensor | None = None,  # [N, n] packed copies (as ``forward``)
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The protocol's cached call (dllm.protocols): new tokens against the cached prefix.  # [N, n, V]

        ``return_hidden``: also return the features the output projection reads (as ``forward``).
        ``logits_at``: logits (and features) only at those input positions, in the model's dtype (as ``forward``).
        ``tree_mask`` with ``position_ids``: a draft tree in one call (``Capabilities.tree_attention``).

        ``commit`` (with ``rows``): the first ``commit`` tokens of every input are the same for all inputs
        of a cache row and never attend to the rest (a finished block before the active one, under
        block-causal attention); their keys/values, taken from each row's first input, are appended to
        ``cache`` after the call. This folds the cache fill into a verification call.
        """
        return _run_stages(self._cached_stages(input_ids, cache, rows=rows, append=append,
                                               attention_mask=attention_mask, block_offset=block_offset,
                                               block_size=block_size, position_ids=position_ids, commit=commit,
                                               return_hidden=return_hidden,
                                               tree_mask=tree_mask, logits_at=logits_at, segments=segments),
                           self.layer_states)

    def _cached_stages(self, input_ids, cache, *, rows=None, append=True, attention_mask=None, block_offset=0,
                       block_size=None, position_ids=None, commit=0, return_hidden=False, tree_mask=None,
                       logits_at=None, segments=None):
        """``forward_cached`` as stages (``_stages``)."""
        main = cache
        if rows is not None:
            if append:
                raise ValueError("forward_cached: rows= reads shared cache rows and cannot append")
            cache = cache.select(rows)
        new_mask = None if attention_mask is None else attention_mask[:, attention_mask.shape[1] - input_ids.shape[1]:]
        out = yield from self._stages(input_ids, attention_mask=new_mask, position_ids=position_ids, cache=cache,
                                      use_cache=append or commit > 0, block_offset=block_offset,
                                      block_size=block_size, return_hidden=return_hidden, tree_mask=tree_mask,
                                      logits_at=logits_at, segments=segments)
        if commit and rows is not None:
            _commit_rows(main, cache, rows, commit)
        return out

    def forward(
        self,
        input_ids: Tensor,  # [B, L]
        attention_mask: Tensor | None = None,  # [B, L] 0/1 padding, or bool [B, Lq, Lk] / [B, 1, Lq, Lk]
        position_ids: Tensor | None = None,  # [B, L]
        cache: KVCache | None = None,
        use_cache: bool = False,
        block_offset: int | Tensor = 0,  # int or [B]; block_causal only
        block_size: int | None = None,  # block_causal only; None: config.block_size
        return_hidden: bool = False,
        tree_mask: Tensor | None = None,  # [B, L, L] bool
        logits_at: Tensor | None = None,  # [B, K] long
        segments: Tensor | None = None,  # [B, L] long
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits at every input position, attending to ``cache`` (if given) then the inputs.  # [B, L, V]

        attention_mask: a [B, L] 0/1 key-padding mask of the inputs (Hugging Face style; combined with
        the layout mask, and default positions start at 0 on each row's first real token), or an explicit
        bool mask over keys = cached + new (True = attend) that replaces the layout mask.
        position_ids: default continues from the cache (0 without one), skipping padding.
        block_offset, block_size (block_causal): blocks of ``block_size`` positions (None: ``config.block_size``)
        start at ``block_offset + k * block_size`` in position ids; a run's block size is passed by the sessions
        where the model's blocks are a run's choice (``Capabilities.run_blocks``), the cache's keys included.
        use_cache: append this call's keys/values to ``cache`` (in place); otherwise the cache is only read.
        With ``shift_logits`` the logits at position p come from the state at p - 1 (cached or new; the
        state itself where p has no predecessor), as Dream's generation code shifts them.
        return_hidden: return ``(logits, features)``, features [B, L, dim] the final-normed states the output
        projection reads at each position (after any shift): what draft heads condition on.
        tree_mask: which inputs each input may attend to (True = attend), replacing the layout among the
        inputs while cached keys keep it, with a 2-D ``attention_mask`` still marking padding: a draft tree
        (siblings at one position) verified in one call; pass the tree's ``position_ids``.
        logits_at: input positions [B, K] (indices into L) whose logits are wanted: the output layer runs on
        those positions' features only and the logits [B, K, V] stay in the model's dtype (at a real vocabulary
        the [B, L, V] float32 tensor of every position is what fills memory; samplers read a few positions).
        segments: several inputs packed in one row (``Capabilities.packs_copies``): segment 0 is a prefix that
        every segment sees (it sees only itself), segment s > 0 sees segment 0 and itself, -1 marks filler; each
        segment s > 0 is placed right after segment 0, so the row's logits equal separate rows [prefix, segment s]
        (fef's verification copies, which would otherwise each read the cache and repeat the prefix).
        """
        return _run_stages(self._stages(input_ids, attention_mask, position_ids, cache, use_cache, block_offset,
                                        block_size, return_hidden, tree_mask, logits_at, segments), self.layer_states)

    def forward_many(self, calls: list[tuple[str, tuple, dict]]) -> list:
        """Several independent calls in one pass -> their answers, in order. A call is ``("forward", args,
        kwargs)`` or ``("forward_cached", args, kwargs)``, as the method would take them (``dllm serve``'s engine
        batches its lanes' calls so). The layers' matmuls run once over every call's tokens, attention per call
        (``layer_states_many``); each answer is its call's alone up to the rounding of a matmul over more rows."""
        stages = [self._cached_stages(*args, **kwargs) if name == "forward_cached" else self._stages(*args, **kwargs)
                  for name, args, kwargs in calls]
        return _finish_stages(stages, self.layer_states_many([next(stage) for stage in stages]))

    def _stages(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False, block_offset=0,
                block_size=None, return_hidden=False, tree_mask=None, logits_at=None, segments=None):
        """``forward`` as a generator: it yields the layers' arguments (input_ids, position_ids, mask, cache, keep,
        bound), is sent their ``layer_states`` answer, and returns the forward's answer; so ``forward_many`` can
        run the layers of several calls together."""
        if use_cache and cache is None:
            raise ValueError("use_cache=True needs a cache to append to: pass cache=model.new_cache()")
        query_valid, explicit = _query_mask(attention_mask, input_ids)
        blocks = self._blocks(block_offset, block_size)
        bound = None  # a host bound of the positions: derived ones never pass cached keys + inputs
        if segments is not None:
            if explicit is not None or tree_mask is not None or position_ids is not None:
                raise ValueError("segments take a 2-D padding attention_mask and no tree_mask or position_ids")
            if self.config.shift_logits:
                raise ValueError("segments cannot pack a model with shifted logits (a state would read another "
                                 "segment's)")
            query_valid = query_valid & (segments >= 0)
            position_ids, tree_mask = self._packed_layout(segments, query_valid, cache, blocks)
            bound = (cache.length if cache is not None else 0) + input_ids.shape[1]
        if position_ids is None:
            start = cache.next_position()[:, None] if cache is not None and cache.length else 0
            position_ids = start + positions_from_mask(query_valid)
            bound = (cache.length if cache is not None else 0) + input_ids.shape[1]
        if tree_mask is not None:
            if explicit is not None:
                raise ValueError("tree_mask takes a 2-D padding attention_mask, not an explicit 3-D/4-D mask")
            if tree_mask.shape != (*input_ids.shape, input_ids.shape[1]) or tree_mask.dtype != torch.bool:
                shape = [*input_ids.shape, input_ids.shape[1]]
                raise ValueError(f"tree_mask must be a bool tensor [B, L, L] = {shape}, "
                                 f"got {tree_mask.dtype} {list(tree_mask.shape)}")
        mask = self._attention_mask(position_ids, query_valid, explicit, cache, blocks, tree_mask)
        h, new_kv = yield input_ids, position_ids, mask, cache, use_cache, bound
        if use_cache:
            cache.append(new_kv, position_ids, query_valid, h if self.config.shift_logits else None)
        if self.config.shift_logits:
            h = _previous_states(h, position_ids, query_valid, cache)
        if logits_at is not None:
            h = gather_positions(h, logits_at)
        return self.head(h, hidden=return_hidden, full_precision=logits_at is None)

    def _packed_layout(self, segments: Tensor, valid: Tensor, cache: KVCache | None,
                       blocks: _Blocks) -> tuple[Tensor, Tensor]:
        """Positions [B, L] and the mask among inputs [B, L, L] of packed ``segments`` (see ``forward``): a token
        of segment s > 0 sits after segment 0's valid tokens and the valid tokens of s before it."""
        start = cache.next_position()[:, None] if cache is not None and cache.length else 0
        same = segments[:, :, None] == segments[:, None, :]  # [B, Lq, Lk]
        earlier = torch.ones_like(same[0]).tril(diagonal=-1)  # [Lq, Lk]: key before query
        before = (same & earlier & valid[:, None, :]).sum(dim=-1)  # valid tokens of the query's segment before it
        shared = (segments == 0) & valid
        prefix = shared.sum(dim=1, keepdim=True)
        position_ids = start + before + torch.where(segments > 0, prefix, 0)
        mask = self._layout(position_ids, position_ids, blocks)
        return position_ids, mask & (same | shared[:, None, :])

    def _hidden(self, input_ids, position_ids, query_valid, explicit, cache, use_cache, blocks: _Blocks,
                tree_mask=None, bound: int | None = None) -> Tensor:
        """Last-layer states of the inputs (before the final norm), appended to ``cache`` if asked.  # [B, L, dim]"""
        mask = self._attention_mask(position_ids, query_valid, explicit, cache, blocks, tree_mask)
        h, new_kv = self.layer_states(input_ids, position_ids, mask, cache, keep=use_cache, bound=bound)
        if use_cache:
            cache.append(new_kv, position_ids, query_valid, h if self.config.shift_logits else None)
        return h

    def structured_verify(
        self,
        input_ids: Tensor,  # [R, L] the state (window positions masked)
        positions: Tensor,  # [R, W] window positions s_j
        drafts: Tensor,  # [R, W] draft tokens d_j
        count: Tensor,  # [R] valid drafts per row
        bonus: Tensor,  # [R] bonus position, -1 for none
        *,
        cache: KVCache | None = None,
        rows: Tensor | None = None,  # [R] cache rows (with cache)
        attention_mask: Tensor | None = None,  # [R, cache.length + L] 0/1
        block_offset: int | Tensor = 0,
        block_size: int | None = None,  # the call's attention blocks (as ``forward``)
    ) -> tuple[Tensor, Tensor]:
        """One-pass verification: target logits [R, W + 1, V] (row count[r] is the bonus) and the state's
        logits [R, L, V].

        The input is the state, then the drafts at their window positions, then one masked query per
        window position and one for the bonus position. Query j sees the state without s_0..s_j, the
        drafts d_<j and itself: the context of fef's copy j, except that the state's other tokens keep
        the representations they have in the state. For a one-layer model that is exactly copy j; deeper
        models match the copies verifier only if trained for this pass (it then defines its own
        conditional), so samplers label its output approximate.
        """
        blocks = self._blocks(block_offset, block_size)
        if cache is not None and rows is not None:
            cache = cache.select(rows)
        n, length = input_ids.shape
        width = positions.shape[1]
        valid = torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is not None:
            valid = attention_mask[:, attention_mask.shape[1] - length:].bool()
        start = cache.next_position()[:, None] if cache is not None and cache.length else 0
        state_pos = start + positions_from_mask(valid)  # [R, L]
        window_pos = state_pos.gather(1, positions)
        bonus_pos = state_pos.gather(1, bonus.clamp(min=0)[:, None])
        mask_id = torch.full_like(drafts, self.mask_token_id)
        tokens = torch.cat([input_ids, drafts, mask_id, mask_id[:, :1]], dim=1)
        pos = torch.cat([state_pos, window_pos, window_pos, bonus_pos], dim=1)
        structure = _structured_mask(positions, count, bonus, length, width)  # [R, Lq, Lq]
        if self.config.shift_logits:
            tokens, pos, structure = _shift_queries(tokens, pos, structure, positions, count, bonus, length,
                                                    cache is not None and bool(cache.length))
        keys_valid = torch.cat([valid, torch.ones_like(tokens[:, length:], dtype=torch.bool)], dim=1)
        mask = structure & self._layout(pos, pos, blocks)
        mask = mask & keys_valid[:, None, :]
        if cache is not None and cache.length:
            past = self._layout(pos, cache.positions, blocks)
            mask = torch.cat([past, mask], dim=2)
        h = self._hidden(tokens, pos, torch.ones_like(tokens, dtype=torch.bool), mask, cache, False, blocks)
        targets = self.head(h[:, length + width :])  # W window queries, then the bonus query
        rows = torch.arange(n, device=targets.device)
        targets[rows, count] = targets[:, -1].clone()  # the bonus goes to row count[r], verify's ragged layout
        state = h[:, :length]
        if self.config.shift_logits:
            state = _previous_states(state, state_pos, valid, cache)
        return targets, self.head(state)

    def _check_positions(self, position_ids: Tensor, bound: int | None = None) -> None:
        """Positions must index the rotary tables (a clear error instead of a device-side assert). ``bound``:
        a host-known upper bound of the positions (cached keys + inputs); below the table's length nothing
        is read from the device (reading the maximum would stall a GPU's pipeline every call)."""
        if bound is not None and bound <= self.config.max_seq_len:
            return
        if position_ids.numel() and int(position_ids.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(position_ids.max())} >= max_seq_len ({self.config.max_seq_len})")

    def _blocks(self, block_offset: int | Tensor, block_size: int | None) -> _Blocks:
        """A call's block layout: ``block_size`` (a run's choice, ``Capabilities.run_blocks``; None: the config's)
        from ``block_offset``."""
        if block_size is None:
            return _Blocks(self.config.block_size, block_offset)
        if self.layout != "block_causal":
            raise ValueError(f"block_size= is for a block_causal model; this one is {self.layout}")
        _check_positive_int("block_size", block_size)
        return _Blocks(block_size, block_offset)

    def _layout(self, query_pos: Tensor, key_pos: Tensor, blocks: _Blocks) -> Tensor:
        """``layout_mask`` of this model's layout in a call's blocks.  # [B, Lq, Lk] bool"""
        return layout_mask(self.layout, query_pos, key_pos, blocks.size, blocks.offset)

    def _attention_mask(self, position_ids, query_valid, explicit, cache, blocks: _Blocks, tree_mask=None) -> Tensor:
        """Layout (or explicit, or layout to the cache and ``tree_mask`` among the inputs) mask over cached + new
        keys, minus padding keys.  # [B, 1, L, P + L] bool"""
        past_pos, past_valid = position_ids[:, :0], query_valid[:, :0]
        if cache is not None and cache.length:
            past_pos, past_valid = cache.positions, cache.valid
        key_pos = torch.cat((past_pos, position_ids), dim=1)
        key_valid = torch.cat((past_valid, query_valid), dim=1)
        if tree_mask is not None:
            past = self._layout(position_ids, past_pos, blocks)
            mask = torch.cat([past, tree_mask], dim=2)
        elif explicit is None:
            mask = self._layout(position_ids, key_pos, blocks)
        elif explicit.shape[-2:] != (position_ids.shape[1], key_pos.shape[1]):
            expected = f"[B, {position_ids.shape[1]}, {key_pos.shape[1]}]"
            raise ValueError(f"explicit attention_mask must be {expected} (queries, cached + new keys), "
                             f"got {tuple(explicit.shape)}")
        else:
            mask = explicit
        mask = _never_empty(mask & key_valid[:, None, :], n_past=past_pos.shape[1])
        return rearrange(mask, "b q k -> b 1 q k")

    def layer_states(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor,
                     cache: KVCache | None = None, keep: bool = True,
                     bound: int | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The layers under a given mask: last-layer states [B, L, dim] (before the final norm) and each
        layer's new keys/values [B, H, L, head_dim], the cache left as it is; with ``keep`` False none are kept
        (an empty list): a call that appends nothing would otherwise hold every layer's keys and values, and
        the projections they view, until it returns (most of a full-depth verification call's memory).

        mask: [B, 1, L, cached + L] bool (True = attend) over ``cache``'s keys then the inputs'. Other
        attention layouts over these weights call this (``dllm.models.two_stream``). ``bound``: a host-known upper
        bound of ``position_ids`` (``_check_positions``); without one their maximum is read."""
        self._check_positions(position_ids, bound)
        cos, sin = self.rotary(position_ids)
        h = self.tok_embeddings(input_ids)
        new_kv = []
        for index, layer in enumerate(self.layers):
            past = cache.layer(index) if cache is not None and cache.length else None
            h, k, v = layer(h, cos, sin, mask, past, keep)
            if keep:
                new_kv.append((k, v))
        return h, new_kv

    def layer_states_many(self, requests: list[tuple]) -> list[tuple[Tensor, list[tuple[Tensor, Tensor]]]]:
        """``layer_states`` of several calls at once -> each call's (states, new keys/values). A request is
        ``(input_ids, position_ids, mask, cache, keep, bound)``. Every matmul (projections, MLP or experts, norms)
        runs once over all the calls' tokens; attention runs per call, against its own cache and mask."""
        rotary, sizes, shapes = [], [], []
        for input_ids, position_ids, _, _, _, bound in requests:
            self._check_positions(position_ids, bound)
            rotary.append(self.rotary(position_ids))
            shapes.append(input_ids.shape)
            sizes.append(input_ids.numel())
        h = torch.cat([self.tok_embeddings(request[0]).flatten(0, 1) for request in requests])[None]  # [1, T, dim]
        new_kv: list[list] = [[] for _ in requests]
        for index, layer in enumerate(self.layers):
            qkv = layer.attn.wqkv(layer.attn_norm(h))[0].split(sizes)
            heads = []
            for n, (part, (_, _, mask, cache, keep, _), (cos, sin), shape) in enumerate(
                    zip(qkv, requests, rotary, shapes, strict=True)):
                past = cache.layer(index) if cache is not None and cache.length else None
                out, k, v = layer.attn.attend(part.view(*shape, -1), cos, sin, mask, past)
                heads.append(out.flatten(0, 1))
                if keep:
                    new_kv[n].append((k, v))
            h = h + layer.attn.wo(torch.cat(heads)[None])
            h = h + layer.mlp(layer.mlp_norm(h))
        states = h[0].split(sizes)
        return [(state.view(*shape, -1), kv) for state, shape, kv in zip(states, shapes, new_kv, strict=True)]

    def head(self, h: Tensor, hidden: bool = False, full_precision: bool = True) -> Tensor | tuple[Tensor, Tensor]:
        """Logits [B, L, V] of last-layer states ``h`` (final norm, output projection, the mask token forbidden
        outside the causal layout), float32 unless ``full_precision`` is False (then the model's dtype);
        ``hidden``: ``(logits, final-normed features)``."""
        features = self.norm(h)
        logits = self._project(features, full_precision)
        return (logits, features) if hidden else logits

    def _project(self, features: Tensor, full_precision: bool = True) -> Tensor:
        """Output projection of final-normed features, float32 unless ``full_precision`` is False (mask token
        forbidden).  # [B, L, V]"""
        logits = self.output(features)
        logits = logits.float() if full_precision else logits
        if self.layout != "causal":
            logits[..., self.mask_token_id] = float("-inf")
        return logits

    def keep_layers(self, indices) -> None:
        """Keep only the layers at ``indices`` (increasing), in place: a shallower model from a trained one
        (layer dropping), e.g. the start of a cheaper drafter that training then adapts."""
        indices = list(indices)
        if not indices or indices != sorted(set(indices)) or indices[0] < 0 or indices[-1] >= len(self.layers):
            raise ValueError(f"layers to keep must be increasing indices in 0..{len(self.layers) - 1}, got {indices}")
        self.layers = nn.ModuleList(self.layers[i] for i in indices)
        moe = self.config.moe  # the kept dense layers still come first
        if moe is not None:
            moe = dataclasses.replace(moe, dense_layers=sum(i < moe.dense_layers for i in indices))
        self.config = dataclasses.replace(self.config, n_layers=len(indices), moe=moe)

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (tied output weight stored once) to folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {name: t.contiguous() for name, t in self.state_dict().items()}
        if self.config.tie_embeddings:
            del state["output.weight"]  # safetensors refuses shared storage; re-tied on load
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        if self.sampler_defaults:
            (folder / DEFAULTS_NAME).write_text(json.dumps(self.sampler_defaults, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None
    ) -> TransformerLM:
        """Load a model saved by ``save_pretrained``; dtype None keeps the saved dtype. Built on the meta device and
        filled tensor by tensor from the memory-mapped file (``dllm.models.checkpoint.load_saved``), so loading peaks
        near the weights' size, not at a random-initialised model plus the whole state dict. A
        ``sampler_defaults.json`` beside the weights gives the settings measured fastest on it."""
        from dllm.models.checkpoint import load_saved

        config = TransformerConfig.from_dict(json.loads((Path(folder) / CONFIG_NAME).read_text()))
        model = load_saved(lambda: cls(config), folder, dtype=dtype, device=device).eval()
        defaults = Path(folder) / DEFAULTS_NAME
        if defaults.is_file():
            table = json.loads(defaults.read_text())
            sampler_defaults_record(table, str(defaults))  # checked here, where the file is named
            model.sampler_defaults = table
        return model
