"""Draft heads for ``ar_spec``: small networks that read a backbone's features and draft through its own output layer.

Two kinds, one file format (``config.json`` with ``kind``, ``model.safetensors``):

- ``"eagle"`` (EAGLE-1, Li et al. 2024, sec. 3): reads the AR target's final-normed feature f_t at the
  last position the target verified and the embedding of the token after it, predicts the next feature
  (then the target's own final norm and output projection, frozen, give the draft's logits) and
  autoregresses on its own features: k head steps per round, no backbone call.
- ``"repair"`` (Domino-style): the diffusion drafter proposes k marginals in one call; the head rewrites
  the block left to right: step j reads the drafter's feature at draft position j, the embedding of the
  repaired token j-1 and its own running state, and adds a correction to the drafter's feature before
  the drafter's output projection. The correction starts at zero, so an untrained repair head drafts
  exactly the marginals.

The heads borrow embeddings, final norm and output projection from the backbone (frozen, never saved
with the head), so they need a ``TransformerLM``-shaped backbone (``backbone_parts``).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .transformer import TransformerLM, _RMSNorm, _SwiGLU

KINDS = ("eagle", "repair")
SHIPPED = Path(__file__).resolve().parent.parent / "weights"
DEFAULT_EAGLE = SHIPPED / "ar_eagle"  # the EAGLE head trained for dllm/weights/ar


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape: ``kind`` (KINDS), the backbone's feature width ``dim`` and vocabulary, MLP width."""

    kind: str
    dim: int
    vocab_size: int
    hidden: int
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"draft head kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("dim", "vocab_size", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft head {name} must be a positive int, got {value!r}")


class _Core(nn.Module):
    """Fuse the normed inputs [R, n * D] into one state [R, D], then one residual SwiGLU block."""

    def __init__(self, config: HeadConfig, inputs: int):
        super().__init__()
        self.norms = nn.ModuleList(_RMSNorm(config.dim, config.norm_eps) for _ in range(inputs))
        self.fuse = nn.Linear(inputs * config.dim, config.dim, bias=False)
        self.mlp_norm = _RMSNorm(config.dim, config.norm_eps)
        self.mlp = _SwiGLU(config.dim, config.hidden)

    def forward(self, *parts: Tensor) -> Tensor:  # each [..., D] -> [..., D]
        h = self.fuse(torch.cat([norm(x) for norm, x in zip(self.norms, parts)], dim=-1))
        return h + self.mlp(self.mlp_norm(h))


class EagleHead(nn.Module):
    """f_{t+1} = norm_target(core(f_t, e(x_{t+1}))): the next feature from a feature and the next token."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.core = _Core(config, 2)

    def forward(self, features: Tensor, embeddings: Tensor) -> Tensor:  # [..., D], [..., D] -> [..., D] (pre-norm)
        return self.core(features, embeddings)


class RepairHead(nn.Module):
    """s_j = core(feat_j, e(tok_{j-1}), s_{j-1}); repaired feature feat_j + out(s_j), ``out`` zero at init."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.core = _Core(config, 3)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        nn.init.zeros_(self.out.weight)  # an untrained head drafts the drafter's own marginals

    def forward(self, features: Tensor, embeddings: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """-> (repaired features [..., D], new state [..., D])."""
        state = self.core(features, embeddings, state)
        return features + self.out(state), state


def backbone_parts(model) -> tuple[nn.Module, nn.Module, object]:
    """(embedding, final norm, output projection of normed features) of a backbone a head can draft through
    (through wrappers such as ``dllm.counting.CountingModel``, which name their model in ``__wrapped__``)."""
    model = inspect.unwrap(model)
    if not isinstance(model, TransformerLM):
        raise TypeError(f"draft heads read a dllm TransformerLM's embeddings and output layer; got "
                        f"{type(model).__name__}")
    return model.tok_embeddings, model.norm, model._project


def eagle_step(head: EagleHead, backbone, features: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """One EAGLE step: features [R, D] at t, tokens [R] at t + 1 -> (features at t + 1 [R, D], logits [R, V])."""
    embed, norm, project = backbone_parts(backbone)
    nxt = norm(head(features, embed(tokens)))
    return nxt, project(nxt)


def eagle_unroll(head: EagleHead, backbone, features: Tensor, tokens: Tensor) -> Tensor:
    """Teacher-forced unroll for training: features [..., D] at t, tokens [..., n] at t+1..t+n ->
    logits [..., n, V] for the tokens at t+2..t+n+1 (step i autoregresses on step i-1's feature)."""
    out = []
    for i in range(tokens.shape[-1]):
        features, logits = eagle_step(head, backbone, features, tokens[..., i])
        out.append(logits)
    return torch.stack(out, dim=-2)


def repair_unroll(head: RepairHead, backbone, features: Tensor, previous: Tensor) -> Tensor:
    """Repair a block: drafter features [..., K, D], tokens before each draft [..., K] (the confirmed one,
    then repaired tokens) -> logits [..., K, V] through the drafter's output projection."""
    embed, _, project = backbone_parts(backbone)
    state = torch.zeros_like(features[..., 0, :])
    out = []
    for j in range(features.shape[-2]):
        repaired, state = head(features[..., j, :], embed(previous[..., j]), state)
        out.append(project(repaired))
    return torch.stack(out, dim=-2)


def new_head(config: HeadConfig) -> EagleHead | RepairHead:
    """A freshly initialised head of ``config.kind``."""
    return (EagleHead if config.kind == "eagle" else RepairHead)(config)


def save_head(head: EagleHead | RepairHead, folder: str | Path, card: str | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (and ``README.md`` when ``card``) to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(head.config), indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if card is not None:
        (folder / "README.md").write_text(card)


def head_config(head) -> HeadConfig:
    """The config of a head module or of a head folder (without loading its weights)."""
    if isinstance(head, EagleHead | RepairHead):
        return head.config
    path = Path(head) / "config.json"
    if not path.is_file():
        raise ValueError(f"draft_head must be a head module or a folder holding config.json; {path} not found")
    return HeadConfig(**json.loads(path.read_text()))


def load_head(head, device=None, dtype=None) -> EagleHead | RepairHead:
    """A head module as it is, or the head saved in folder ``head``, in eval mode."""
    if isinstance(head, EagleHead | RepairHead):
        return head
    module = new_head(head_config(head))
    module.load_state_dict(load_file(str(Path(head) / "model.safetensors")))
    return module.to(device=device, dtype=dtype).eval()


def check_head(head, kind: str, backbone) -> HeadConfig:
    """A head of ``kind`` whose width and vocabulary fit ``backbone``, or a ValueError naming draft_head."""
    config = head_config(head)
    if config.kind != kind:
        raise ValueError(f"draft_head is a {config.kind!r} head; this drafter needs a {kind!r} head "
                         f"(drafter='head' takes an 'eagle' head, a diffusion drafter a 'repair' head)")
    backbone_parts(backbone)
    dim, vocab = backbone.config.dim, backbone.vocab_size
    if (config.dim, config.vocab_size) != (dim, vocab):
        raise ValueError(f"draft_head has dim {config.dim} and vocabulary {config.vocab_size}; its backbone has "
                         f"dim {dim} and vocabulary {vocab}")
    return config
