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
from functools import cache, lru_cache
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

    def start(self, features: Tensor, base_logits: Tensor, compiled: bool = False) -> HeadSteps:
        """Draft a window step by step: ``start(features [R, W, D], base_logits [R, W, V]).next(previous [R],
        offset [R]) -> logits [R, V]`` for steps 0, 1, ... in turn, each attending to the earlier steps' cached
        keys and values: ``forward``'s logits on the prefix, at one step's cost instead of the prefix's.
        ``compiled``: each step runs through ``torch.compile`` (CUDA graphs on a GPU; see ``HeadSteps``)."""
        self.check_backbone(base_logits.shape[-1], features.shape[-1])
        return HeadSteps(self, features, base_logits, compiled)

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

    Shapes are static within a window: each layer's keys and values live in a [R, H, W, dim / H] buffer that
    step j writes at slot j, and step j attends to slots 0..j through a mask (the masked slots weigh exactly
    nothing). So every step of a window of W is the same tensor program (``_head_step``), which
    ``compiled=True`` hands to ``torch.compile`` once per (rows, W) bucket (``mode="reduce-overhead"``, CUDA
    graphs, on a GPU). Off by default: on the 2-core CPU of docs/measurements.md a compiled step is slower than
    the eager one (the step is a few small matmuls; the compiled call's guards cost more than the fusion saves).
    """

    def __init__(self, head: DraftHead, features: Tensor, base_logits: Tensor, compiled: bool = False):
        config = head.config
        self.config, self.j, self.base = config, 0, base_logits.float()
        rows, width = features.shape[:2]
        steps = torch.arange(width, device=features.device).clamp(max=config.max_window - 1)
        with torch.no_grad():
            self.inputs = head.feature_in(features.to(head.feature_in.weight.dtype)) + head.step_in(steps)[None]
        # The weights as plain tensors: a step is ~30 small ops, and module calls would double its cost.
        self.token_in, self.offset_in = head.token_in.weight, head.offset_in.weight
        self.weights = tuple((layer.norm1.weight, layer.norm1.bias, layer.self_attn.in_proj_weight,
                              layer.self_attn.in_proj_bias, layer.self_attn.out_proj.weight,
                              layer.self_attn.out_proj.bias, layer.norm2.weight, layer.norm2.bias,
                              layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
                             for layer in head.layers)
        self.weights += ((head.norm.weight, head.norm.bias, head.out.weight, head.out.bias),)
        heads = config.n_heads
        shape = (rows, heads, width, config.dim // heads)
        self.keys = tuple(self.inputs.new_zeros(shape) for _ in head.layers)
        self.values = tuple(self.inputs.new_zeros(shape) for _ in head.layers)
        slots = torch.arange(width, device=features.device)
        self.slot = (slots[:, None] == slots[None, :]).view(width, 1, 1, width, 1)  # step j writes slot j
        self.seen = (slots[None, :] <= slots[:, None]).view(width, 1, 1, 1, width)  # and reads slots <= j
        self.step = _compiled_step(features.device) if compiled else _head_step

    @torch.no_grad()
    def next(self, previous: Tensor, offset: Tensor) -> Tensor:
        """Logits of the next step [R, V] given the token before it [R] and its offset [R] (both ignored at
        step 0 unless ``condition_first``)."""
        config, j = self.config, self.j
        if j >= self.inputs.shape[1]:
            raise IndexError(f"the window has {self.inputs.shape[1]} steps; step {j} asked")
        later = j > 0 or config.condition_first
        if later:
            limit = config.max_offset
            h = self.inputs[:, j] + self.token_in[previous.clamp(min=0)] \
                + self.offset_in[offset.clamp(-limit, limit) + limit]
            correction, self.keys, self.values = self.step(h, self.keys, self.values, self.slot[j], self.seen[j],
                                                           self.weights, config.n_heads)
            logits = self.base[:, j] + correction.float()
        else:  # step 0 of a block-diffusion head: the marginal itself (its keys and values still feed step 1)
            _, self.keys, self.values = self.step(self.inputs[:, 0], self.keys, self.values, self.slot[0],
                                                  self.seen[0], self.weights, config.n_heads)
            logits = self.base[:, j].clone()
        if config.mask_token_id is not None and config.mask_token_id < logits.shape[-1]:
            logits[:, config.mask_token_id] = float("-inf")
        self.j += 1
        return logits


def _head_step(h: Tensor, keys: tuple, values: tuple, slot: Tensor, seen: Tensor, weights: tuple, heads: int):
    """One head step on static shapes: the step's input h [R, dim], each layer's key/value buffers
    [R, H, W, dim / H] (this step's written at ``slot`` [1, 1, W, 1], slots ``seen`` [1, 1, 1, W] attended)
    -> (the correction to the base logits [R, V], the new buffers)."""
    rows = h.shape[0]
    new_keys, new_values = [], []
    *layers, (norm_w, norm_b, out_w, out_b) = weights
    for (n1w, n1b, w_qkv, b_qkv, w_o, b_o, n2w, n2b, w_1, b_1, w_2, b_2), k_buf, v_buf in zip(layers, keys, values):
        y = F.layer_norm(h, n1w.shape, n1w, n1b)
        q, k, v = F.linear(y, w_qkv, b_qkv).reshape(rows, 3, heads, 1, -1).unbind(1)  # [R, H, 1, dim / H]
        k_buf, v_buf = torch.where(slot, k, k_buf), torch.where(slot, v, v_buf)
        new_keys.append(k_buf)
        new_values.append(v_buf)
        h = h + F.linear(F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=seen).reshape(rows, -1), w_o, b_o)
        y = F.layer_norm(h, n2w.shape, n2w, n2b)
        h = h + F.linear(F.gelu(F.linear(y, w_1, b_1)), w_2, b_2)
    return F.linear(F.layer_norm(h, norm_w.shape, norm_w, norm_b), out_w, out_b), tuple(new_keys), tuple(new_values)


@cache
def _compiled_step(device: torch.device):
    """``_head_step`` through ``torch.compile`` (static shapes; CUDA graphs on a GPU), built once per device type."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else None
    return torch.compile(_head_step, dynamic=False, mode=mode)


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
