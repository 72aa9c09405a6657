"""A small causal draft head for fef: drafts a window from the state's features in W cheap head steps.

Step j of a window reads the backbone's features at the target position s_j (from the state call fef
already makes), the embedding of the previous draft d_{j-1}, the offset s_j - s_{j-1} and the step index,
and attends causally to steps 0..j-1, so draft j is conditioned on drafts 0..j-1 as the verifier's
target is. Its logits are the backbone's own marginal at s_j plus a learned correction (zero-initialised:
an untrained head drafts exactly the marginals). Step 0 keeps the marginal untouched: copy 0 of the
verify call is the state itself, so the marginal there is already the target. A head for the two-stream
layout (``condition_first``) corrects step 0 too, reading the token emitted just before the window.

Saved as a folder like ``TransformerLM.save_pretrained``: ``config.json`` and ``model.safetensors``.
Exactness never depends on the head: fef tests drafts against the very logits they were sampled from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from dllm.models.checkpoint import load_saved

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
KIND = "dllm-fef-draft-head"  # written in config.json so another folder is refused by name


@dataclass(frozen=True)
class DraftHeadConfig:
    """Shapes of a DraftHead and the backbone it reads (validated on construction)."""

    vocab_size: int  # the backbone's vocabulary (its logits' width)
    backbone_dim: int  # width of the backbone's features (``return_hidden``)
    dim: int = 128
    n_layers: int = 1
    n_heads: int = 4
    max_window: int = 16  # step embeddings; later steps share the last one
    max_offset: int = 16  # |s_j - s_{j-1}| beyond this shares the extreme embedding
    mask_token_id: int | None = None  # never drafted
    # Step 0 also reads the token emitted just before the window and its offset, and is corrected: on a
    # two-stream model the window's first query did not see that token (samplers/fef/two_stream.py). False for
    # fef on a block-diffusion model, whose step 0 is the state's own marginal, already the target.
    condition_first: bool = False

    def __post_init__(self):
        if not isinstance(self.condition_first, bool):
            raise ValueError(f"DraftHeadConfig.condition_first must be a bool, got {self.condition_first!r}")
        for name in ("vocab_size", "backbone_dim", "dim", "n_layers", "n_heads", "max_window", "max_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DraftHeadConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"DraftHeadConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DraftHeadConfig:
        """Build from config.json's dict, refusing unknown keys (typos must not pass silently)."""
        values = dict(values)
        kind = values.pop("kind", None)
        if kind != KIND:
            raise ValueError(f"not a fef draft head: config.json has kind={kind!r}, expected {KIND!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"unknown DraftHeadConfig keys {unknown}; allowed keys: {names}")
        return cls(**values)


class DraftHead(nn.Module):
    """Causal head over window steps: (features, marginal logits, previous drafts, offsets) -> logits."""

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.config = config
        dim = config.dim
        self.feature_in = nn.Linear(config.backbone_dim, dim)
        self.token_in = nn.Embedding(config.vocab_size, dim)  # the previous draft d_{j-1}
        self.offset_in = nn.Embedding(2 * config.max_offset + 1, dim)
        self.step_in = nn.Embedding(config.max_window, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, config.n_heads, 4 * dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, config.vocab_size)
        nn.init.zeros_(self.out.weight)  # zero correction: an untrained head drafts the marginals
        nn.init.zeros_(self.out.bias)

    def check_backbone(self, vocab_size: int, feature_dim: int | None = None, name: str = "draft_head") -> None:
        """Refuse a backbone whose vocabulary (or feature width, where known) is not the head's."""
        if vocab_size != self.config.vocab_size:
            raise ValueError(f"{name} was trained for a vocabulary of {self.config.vocab_size} tokens; this model "
                             f"has {vocab_size}: pass draft_head= a head trained for this model")
        if feature_dim is not None and feature_dim != self.config.backbone_dim:
            raise ValueError(f"{name} reads features of width {self.config.backbone_dim}; this model's features "
                             f"are {feature_dim} wide: pass draft_head= a head trained for this model")

    def forward(
        self,
        features: Tensor,  # [R, J, D] backbone features at s_0..s_{J-1}
        base_logits: Tensor,  # [R, J, V] the backbone's marginals there
        previous: Tensor,  # [R, J] long: d_{j-1} at slot j (slot 0: the token before the window, or ignored)
        offsets: Tensor,  # [R, J] long: s_j - s_{j-1} (slot 0: from that token's position, or ignored)
    ) -> Tensor:
        """Draft logits for steps 0..J-1, step j attending to steps <= j -> [R, J, V] float32."""
        self.check_backbone(base_logits.shape[-1], features.shape[-1])
        steps = features.shape[1]
        j = torch.arange(steps, device=features.device)
        # Step 0 has no previous draft: its token and offset inputs are dropped, unless condition_first.
        later = ((j > 0) | self.config.condition_first)[None, :]
        limit = self.config.max_offset
        weight = self.feature_in.weight
        h = self.feature_in(features.to(weight.dtype)) + self.step_in(j.clamp(max=self.config.max_window - 1))[None]
        h = h + later[..., None] * (self.token_in(previous.clamp(min=0))
                                    + self.offset_in(offsets.clamp(-limit, limit) + limit))
        causal = torch.triu(torch.ones(steps, steps, dtype=torch.bool, device=h.device), diagonal=1)
        for layer in self.layers:
            h = layer(h, src_mask=causal)
        delta = self.out(self.norm(h)).float() * later[..., None]
        logits = base_logits.float() + delta
        if self.config.mask_token_id is not None and self.config.mask_token_id < logits.shape[-1]:
            logits[..., self.config.mask_token_id] = float("-inf")
        return logits

    def start(self, features: Tensor, base_logits: Tensor) -> HeadSteps:
        """Draft a window step by step: ``start(features [R, W, D], base_logits [R, W, V]).next(previous [R],
        offset [R]) -> logits [R, V]`` for steps 0, 1, ... in turn, each attending to the earlier steps' cached
        keys and values: ``forward``'s logits on the prefix, at one step's cost instead of the prefix's."""
        self.check_backbone(base_logits.shape[-1], features.shape[-1])
        return HeadSteps(self, features, base_logits)

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``config.json`` (with kind) and ``model.safetensors`` to ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"kind": KIND, **dataclasses.asdict(self.config)}
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device | None = None) -> DraftHead:
        """Load a head saved by ``save_pretrained`` (eval mode, float32), tensor by tensor into a meta-built head."""
        folder = Path(folder)
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise ValueError(f"draft_head={str(folder)!r} is not a draft-head folder "
                             f"(needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        config = DraftHeadConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text()))
        return load_saved(lambda: cls(config), folder, dtype=torch.float32, device=device).eval()


class HeadSteps:
    """A window's incremental head pass (``DraftHead.start``); no gradient.

    Written out because the window's steps are sequential (step j reads draft j-1, sampled from step j-1):
    ``nn.TransformerEncoderLayer`` has no key/value cache, and re-running it on each prefix costs W passes of
    PyTorch call overhead per step. The arithmetic is the layer's own (pre-norm attention, then pre-norm
    GELU MLP, on its weights); tests/test_fef_head.py checks the logits equal ``forward``'s.
    """

    def __init__(self, head: DraftHead, features: Tensor, base_logits: Tensor):
        config = head.config
        self.config, self.j, self.base = config, 0, base_logits.float()
        steps = torch.arange(features.shape[1], device=features.device).clamp(max=config.max_window - 1)
        with torch.no_grad():
            self.inputs = head.feature_in(features.to(head.feature_in.weight.dtype)) + head.step_in(steps)[None]
        # The weights as plain tensors: a step is ~30 small ops, and module calls would double its cost.
        self.token_in, self.offset_in = head.token_in.weight, head.offset_in.weight
        self.layers = [(layer.norm1, layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias,
                        layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias, layer.norm2,
                        layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
                       for layer in head.layers]
        self.norm, self.out = head.norm, (head.out.weight, head.out.bias)
        self.keys: list[Tensor | None] = [None] * len(self.layers)
        self.values: list[Tensor | None] = [None] * len(self.layers)

    @torch.no_grad()
    def next(self, previous: Tensor, offset: Tensor) -> Tensor:
        """Logits of the next step [R, V] given the token before it [R] and its offset [R] (both ignored at
        step 0 unless ``condition_first``)."""
        config, j = self.config, self.j
        if j >= self.inputs.shape[1]:
            raise IndexError(f"the window has {self.inputs.shape[1]} steps; step {j} asked")
        h = self.inputs[:, j]
        later = j > 0 or config.condition_first
        if later:
            limit = config.max_offset
            h = h + self.token_in[previous.clamp(min=0)] + self.offset_in[offset.clamp(-limit, limit) + limit]
        rows, heads = h.shape[0], config.n_heads
        for index, (norm1, w_qkv, b_qkv, w_o, b_o, norm2, w_1, b_1, w_2, b_2) in enumerate(self.layers):
            y = F.layer_norm(h, norm1.normalized_shape, norm1.weight, norm1.bias, norm1.eps)
            q, k, v = F.linear(y, w_qkv, b_qkv).reshape(rows, 3, heads, 1, -1).unbind(1)  # [R, H, 1, dim / H]
            if self.keys[index] is not None:
                k = torch.cat([self.keys[index], k], dim=2)
                v = torch.cat([self.values[index], v], dim=2)
            self.keys[index], self.values[index] = k, v
            h = h + F.linear(F.scaled_dot_product_attention(q, k, v).reshape(rows, -1), w_o, b_o)
            y = F.layer_norm(h, norm2.normalized_shape, norm2.weight, norm2.bias, norm2.eps)
            h = h + F.linear(F.gelu(F.linear(y, w_1, b_1)), w_2, b_2)
        if later:
            norm = self.norm
            y = F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            logits = self.base[:, j] + F.linear(y, *self.out).float()
        else:
            logits = self.base[:, j].clone()
        if config.mask_token_id is not None and config.mask_token_id < logits.shape[-1]:
            logits[:, config.mask_token_id] = float("-inf")
        self.j += 1
        return logits


def load_draft_head(value: str | Path | DraftHead, device: str | torch.device | None = None) -> DraftHead:
    """A head from a folder (loaded once per folder and modification time) or a DraftHead as it is; a shipped
    head's bare name (``"fef_head"``, ``"two_stream_head"``) is its folder in ``dllm/weights``, from anywhere."""
    if isinstance(value, DraftHead):
        return value
    if not isinstance(value, str | Path):
        raise TypeError(f"draft_head must be a head folder or a DraftHead, got {type(value).__name__}")
    from dllm.models.loading import shipped_or_path

    folder = shipped_or_path(value).resolve()
    stamp = (folder / WEIGHTS_NAME).stat().st_mtime_ns if (folder / WEIGHTS_NAME).is_file() else 0
    return _cached_head(str(folder), stamp, str(device) if device is not None else None)


@lru_cache(maxsize=8)
def _cached_head(folder: str, stamp: int, device: str | None) -> DraftHead:
    # Benches and evals call generate many times with the same folder: read it once. Heads are not
    # trained in place after loading (training builds its own), so sharing the module is safe.
    return DraftHead.from_pretrained(folder, device=device)
