"""A small causal draft head for fef: drafts a window from the state's features in W cheap head steps.

Step j of a window reads the backbone's features at the target position s_j (from the state call fef
already makes), the embedding of the previous draft d_{j-1}, the offset s_j - s_{j-1} and the step index,
and attends causally to steps 0..j-1, so draft j is conditioned on drafts 0..j-1 as the verifier's
target is. Its logits are the backbone's own marginal at s_j plus a learned correction (zero-initialised:
an untrained head drafts exactly the marginals). Step 0 keeps the marginal untouched: copy 0 of the
verify call is the state itself, so the marginal there is already the target.

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
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

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

    def __post_init__(self):
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
        previous: Tensor,  # [R, J] long: d_{j-1} at slot j (slot 0 is ignored)
        offsets: Tensor,  # [R, J] long: s_j - s_{j-1} (slot 0 is ignored)
    ) -> Tensor:
        """Draft logits for steps 0..J-1, step j attending to steps <= j -> [R, J, V] float32."""
        self.check_backbone(base_logits.shape[-1], features.shape[-1])
        steps = features.shape[1]
        j = torch.arange(steps, device=features.device)
        later = (j > 0)[None, :]  # step 0 has no previous draft: its token and offset inputs are dropped
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
        """Load a head saved by ``save_pretrained`` (eval mode, float32)."""
        folder = Path(folder)
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise ValueError(f"draft_head={str(folder)!r} is not a draft-head folder "
                             f"(needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        head = cls(DraftHeadConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text())))
        missing, unexpected = head.load_state_dict(load_file(str(folder / WEIGHTS_NAME)), strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder / WEIGHTS_NAME} does not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        return head.to(device=device).eval()


def load_draft_head(value: str | Path | DraftHead, device: str | torch.device | None = None) -> DraftHead:
    """A head from a folder (loaded once per folder and modification time) or a DraftHead as it is."""
    if isinstance(value, DraftHead):
        return value
    if not isinstance(value, str | Path):
        raise TypeError(f"draft_head must be a head folder or a DraftHead, got {type(value).__name__}")
    folder = Path(value).resolve()
    stamp = (folder / WEIGHTS_NAME).stat().st_mtime_ns if (folder / WEIGHTS_NAME).is_file() else 0
    return _cached_head(str(folder), stamp, str(device) if device is not None else None)


@lru_cache(maxsize=8)
def _cached_head(folder: str, stamp: int, device: str | None) -> DraftHead:
    # Benches and evals call generate many times with the same folder: read it once. Heads are not
    # trained in place after loading (training builds its own), so sharing the module is safe.
    return DraftHead.from_pretrained(folder, device=device)
