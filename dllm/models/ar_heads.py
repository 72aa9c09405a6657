"""Draft heads for ``ar_spec``: small networks that read a backbone's features and draft through its own output layer.

Two kinds, one file format (``config.json`` with ``kind``, ``model.safetensors``):

- ``"eagle"`` (EAGLE, Li et al. 2024; EAGLE-3's training-time test): one pre-norm transformer layer
  over pairs (target feature f_i, embedding of token i + 1), causal over the last ``context`` positions
  whose features the target computed; its output, through the target's own final norm and output
  projection (frozen), drafts token i + 2 and stands in for f_{i+1} at the next step, so k head steps
  draft k tokens with no backbone call, each step attending to the true features of the context and to
  the head's own earlier steps (``eagle_draft``; ``eagle_train_logits`` unrolls the same steps in
  parallel for training).
- ``"dflash"`` (DFlash-style): the same (feature, next token) pairs, then k - 1 learned slot inputs
  standing for the undrafted positions (one per depth, so each knows which draft it is); ``layers``
  pre-norm transformer layers draft all k tokens in ONE pass (``dflash_draft``): draft j is read at the
  j-th input after the context, independent of the other drafts given the context, so a round costs one
  head call however long the block. Causal attention
  (slots see the context and the slots before them), trained with every depth from every answer
  position in one pass (``dflash_train_logits``; with one layer it equals the drafting call exactly; with
  more, the context's earliest positions see a shorter past when drafting than in training, where every
  position sees ``context`` keys, unless the context reaches back to the sequence's start).
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
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from .checkpoint import load_saved
from .transformer import TransformerConfig, TransformerLM, _apply_rotary, _Block, _RMSNorm, _Rotary, _SwiGLU

KINDS = ("eagle", "dflash", "repair")
FEATURE_KINDS = ("eagle", "dflash")  # heads on the AR target's own features (drafter="head")
ROTARY_LEN = 4096  # positions the EAGLE head's rotary tables cover (training sequences, context + drafts)
SHIPPED = Path(__file__).resolve().parent.parent / "weights"
DEFAULT_EAGLE = SHIPPED / "ar_eagle"  # the EAGLE head trained for dllm/weights/ar


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape: ``kind`` (KINDS), the backbone's feature width ``dim`` and vocabulary, MLP width;
    an EAGLE or DFlash head's attention heads and ``context`` (target features it attends to before its
    drafts); a DFlash head's ``layers`` (an EAGLE head has one)."""

    kind: str
    dim: int
    vocab_size: int
    hidden: int
    norm_eps: float = 1e-5
    n_heads: int = 4
    context: int = 64
    layers: int = 1
    max_drafts: int = 16  # a DFlash head's slots: k <= max_drafts drafts a round

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"draft head kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("dim", "vocab_size", "hidden", "n_heads", "context", "layers", "max_drafts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft head {name} must be a positive int, got {value!r}")
        if self.kind != "dflash" and self.layers != 1:
            raise ValueError(f"a {self.kind} head has one layer; layers={self.layers} is for a dflash head")
        if self.kind in FEATURE_KINDS and (self.dim % self.n_heads or (self.dim // self.n_heads) % 2):
            raise ValueError(f"a {self.kind} head's dim ({self.dim}) must split into n_heads ({self.n_heads}) heads of "
                             "even width (rotary positions)")


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


def _keys_values(block: _Block, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's keys and values of inputs x [R, L, D] (as its attention computes them) -> 2 x [R, H, L, Dh]."""
    attn = block.attn
    width = attn.n_kv_heads * attn.head_dim
    _, k, v = attn.wqkv(block.attn_norm(x)).split([attn.n_heads * attn.head_dim, width, width], dim=-1)
    k = _apply_rotary(k.unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(1, 2), cos, sin)
    return k, v.unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(1, 2)


def _last_only(block: _Block, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past, last: int | None):
    """``block(x, cos, sin, mask, past)`` -> (out, keys, values), with ``last``: outputs of the last ``last``
    inputs only (keys and values of all), the earlier ones' queries and MLP skipped."""
    if last is None or last >= x.shape[1]:
        return block(x, cos, sin, mask, past)
    split = x.shape[1] - last
    k, v = _keys_values(block, x[:, :split], cos[:, :split], sin[:, :split])
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    out, k_last, v_last = block(x[:, split:], cos[:, split:], sin[:, split:], mask[:, :, split:], (k, v))
    return out, torch.cat([k[:, :, -split:], k_last], dim=2), torch.cat([v[:, :, -split:], v_last], dim=2)


class _PairHead(nn.Module):
    """What the EAGLE and DFlash heads share: fused, normed (feature, next-token embedding) pairs and the
    rotary tables of ``layers`` transformer layers of the target's shape."""

    def __init__(self, config: HeadConfig, layers: int):
        super().__init__()
        self.config = config
        self.norms = nn.ModuleList(_RMSNorm(config.dim, config.norm_eps) for _ in range(2))
        self.fuse = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.layer = TransformerConfig(vocab_size=config.vocab_size, dim=config.dim, n_layers=layers,
                                       n_heads=config.n_heads, mlp_hidden=config.hidden, max_seq_len=ROTARY_LEN,
                                       norm_eps=config.norm_eps)
        self.rotary = _Rotary(self.layer.head_dim, ROTARY_LEN, self.layer.rope_theta)

    def _inputs(self, features: Tensor, embeddings: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> (fused pairs [R, L, D], rotary cos, sin at ``positions``)."""
        x = self.fuse(torch.cat([self.norms[0](features), self.norms[1](embeddings)], dim=-1))
        return (x, *self.rotary(positions))


class EagleHead(_PairHead):
    """h_i = block(fuse(norm(f_i), norm(e(x_{i+1})))): one causal transformer layer over (feature, next token)
    pairs; norm_target(h_i) is the predicted f_{i+1} (its logits draft x_{i+2})."""

    def __init__(self, config: HeadConfig):
        super().__init__(config, 1)
        self.block = _Block(self.layer)

    def forward(self, features: Tensor, embeddings: Tensor, positions: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None = None, last: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """features, embeddings [R, L, D], positions [R, L], mask [R, 1, L, P + L] (True: attend), keys and
        values of P earlier inputs -> (outputs [R, L, D] before the target's final norm, this call's keys and
        values [R, H, L, Dh]). ``last``: outputs of the last ``last`` inputs only (keys and values of all):
        a context's earlier outputs are never read, and the layer's MLP over them would dominate a round."""
        x, cos, sin = self._inputs(features, embeddings, positions)
        return _last_only(self.block, x, cos, sin, mask, past, last)


class DFlashHead(_PairHead):
    """h = layers(fuse(norm(f_i), norm(e(x_{i+1})))) over the context's pairs and then k - 1 learned slots
    (``slot`` [max_drafts - 1, 2, D]: per depth a stand-in feature and embedding); norm_target(h) at the
    context's last pair and at slot j draft the block's tokens 0 and j."""

    def __init__(self, config: HeadConfig):
        super().__init__(config, config.layers)
        self.blocks = nn.ModuleList(_Block(self.layer) for _ in range(config.layers))
        # normed before use: only their directions count
        self.slot = nn.Parameter(torch.randn(config.max_drafts - 1, 2, config.dim) * 0.02)

    def forward(self, features: Tensor, embeddings: Tensor, positions: Tensor, mask: Tensor,
                last: int | None = None) -> Tensor:
        """features, embeddings [R, L, D] (slots included), positions [R, L], mask [R, 1, L, L] (True: attend)
        -> outputs [R, L, D] before the target's final norm (``last``: of the last ``last`` inputs only, the
        drafts': the last layer then runs its queries and MLP on those alone)."""
        x, cos, sin = self._inputs(features, embeddings, positions)
        *early, final = self.blocks
        for block in early:
            x, _, _ = block(x, cos, sin, mask, None)
        return _last_only(final, x, cos, sin, mask, None, last)[0]

    def slots(self, rows: int, count: int, repeat: int = 1) -> tuple[Tensor, Tensor]:
        """The inputs of slots 1..count (each ``repeat`` times in a row) -> (features, embeddings), each
        [rows, count * repeat, D]."""
        if count > self.slot.shape[0]:
            raise ValueError(f"a dflash head with max_drafts={self.config.max_drafts} drafts at most that many "
                             f"tokens a round, asked for {count + 1}")
        slot = self.slot[:count].repeat_interleave(repeat, dim=0)
        return slot[:, 0].expand(rows, -1, -1), slot[:, 1].expand(rows, -1, -1)


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


def _causal_mask(valid: Tensor) -> Tensor:
    """Causal attention over inputs [R, L] whose ``valid`` ones may be attended to -> [R, 1, L, L]; a padded
    query attends to itself (its output is never read)."""
    size = valid.shape[1]
    causal = torch.ones((size, size), dtype=torch.bool, device=valid.device).tril()
    return ((causal & valid[:, None, :]) | torch.eye(size, dtype=torch.bool, device=valid.device))[:, None]


def _context_keys(offset: Tensor, valid: Tensor, t: int, window: int) -> Tensor:
    """Training masks' real-pair part for depth t [B, L, L]: query i sees the valid keys j with
    i - t - window < j <= i - t (``offset`` [L, L] is j - i); at depth 0 a padded query sees itself."""
    base = (offset <= -t) & (offset > -t - window) & valid[:, None, :]
    return base | ((offset == 0) & (t == 0))


def eagle_draft(head: EagleHead, backbone, features: Tensor, tokens: Tensor, valid: Tensor, k: int,
                pick, done=None) -> tuple[Tensor, Tensor]:
    """Draft k tokens after a context of C positions: the target's features [R, C, D] at positions
    n - 1 - C .. n - 2, the tokens after each (positions n - C .. n - 1) [R, C], which context positions
    hold real features [R, C] bool (the last one must), ``pick`` (logits [R, V] -> tokens [R]) ->
    (logits [R, k', V] each draft was picked from, drafts [R, k']). k' = k, or fewer when ``done``
    (called once per step with its logits [R, V] and drafts [R] -> [R] bool: the row needs no more drafts)
    has held for every row. Differentiable (no no_grad here)."""
    embed, norm, project = backbone_parts(backbone)
    rows, width = tokens.shape
    mask = _causal_mask(valid)
    positions = torch.arange(width, device=tokens.device).expand(rows, width)
    out, keys, values = head(features, embed(tokens), positions, mask, last=1)
    feature, logits, drafts = norm(out), [], []
    keep = valid[:, None, None, :]
    finished = torch.zeros(rows, dtype=torch.bool, device=tokens.device)
    steps = _EagleSteps(head, embed, norm, keys, values, keep, k) if _EagleSteps.applies(head) else None
    for j in range(k):
        logits.append(project(feature[:, 0]))
        drafts.append(pick(logits[-1]))
        if done is not None:
            finished |= done(logits[-1], drafts[-1])
        if j == k - 1 or bool(finished.all()):
            break
        if steps is not None:
            feature = steps.next(feature, drafts[-1])
            continue
        step_mask = torch.cat([keep, keep.new_ones((rows, 1, 1, j + 1))], dim=-1)
        at = torch.full((rows, 1), width + j, device=tokens.device)
        out, k_new, v_new = head(feature, embed(drafts[-1])[:, None], at, step_mask, (keys, values))
        keys, values = torch.cat([keys, k_new], dim=2), torch.cat([values, v_new], dim=2)
        feature = norm(out)
    return torch.stack(logits, dim=1), torch.stack(drafts, dim=1)


class _EagleSteps:
    """``eagle_draft``'s steps after the context call, written out for inference (no gradient): the head's own
    arithmetic on plain tensors (fuse, pre-norm attention with rotary positions, SwiGLU, the target's final norm),
    its keys and values in one buffer of C + k slots that step j writes at slot C + j and reads through a mask.

    Why by hand: a step is one token through one layer, about forty small operations, and the module path
    (module calls, einops rearranges, a growing ``torch.cat`` of the keys per step) costs more than the arithmetic
    on a CPU. ``tests/test_ar_heads.py`` holds ``eagle_draft`` to the training path's logits either way."""

    @staticmethod
    def applies(head) -> bool:
        """Inference on a plain EAGLE layer (no gradient; no q/k norms, grouped heads or experts: the module path)."""
        if torch.is_grad_enabled() or not isinstance(head, EagleHead):
            return False
        attn = head.block.attn
        return not attn.qk_norm and attn.n_kv_heads == attn.n_heads and isinstance(head.block.mlp, _SwiGLU)

    def __init__(self, head: EagleHead, embed, norm, keys: Tensor, values: Tensor, keep: Tensor, k: int):
        rows, heads, context, size = keys.shape
        self.embed, self.norms, self.fuse, self.target_norm = embed.weight, head.norms, head.fuse.weight, norm
        block = head.block
        self.block, self.heads = block, heads
        self.keys = keys.new_zeros((rows, heads, context + k, size))
        self.values = values.new_zeros((rows, heads, context + k, size))
        self.keys[:, :, :context], self.values[:, :, :context] = keys, values
        slots = torch.arange(k, device=keys.device)
        self.masks = torch.cat([keep.expand(rows, 1, k, context),
                                (slots[None, :] <= slots[:, None]).expand(rows, 1, k, k)], dim=-1)  # [R, 1, k, C + k]
        cos, sin = head.rotary(torch.arange(context, context + k, device=keys.device)[None])
        self.cos, self.sin = cos.expand(rows, -1, -1), sin.expand(rows, -1, -1)  # [R, k, R/2]
        self.context, self.j = context, 0

    def next(self, feature: Tensor, token: Tensor) -> Tensor:
        """The head's next output feature (final-normed) [R, 1, D] from the last one [R, 1, D] and the token just
        drafted [R]."""
        j, block, attn = self.j, self.block, self.block.attn
        rows = token.shape[0]
        pair = torch.cat([_rms(feature[:, 0], self.norms[0]), _rms(F.embedding(token, self.embed), self.norms[1])], -1)
        x = F.linear(pair, self.fuse)  # [R, D]
        qkv = F.linear(_rms(x, block.attn_norm), attn.wqkv.weight, attn.wqkv.bias)
        q, k, v = qkv.view(rows, 3, self.heads, 1, -1).unbind(1)  # [R, H, 1, Dh]
        cos, sin = self.cos[:, j : j + 1], self.sin[:, j : j + 1]
        at = self.context + j
        self.keys[:, :, at], self.values[:, :, at] = _apply_rotary(k, cos, sin)[:, :, 0], v[:, :, 0]
        out = F.scaled_dot_product_attention(_apply_rotary(q, cos, sin), self.keys, self.values,
                                             attn_mask=self.masks[:, :, j : j + 1])
        x = x + attn.wo(out.reshape(rows, -1))
        gate, up = F.linear(_rms(x, block.mlp_norm), block.mlp.w13.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, block.mlp.w2.weight)
        self.j += 1
        return _rms(x, self.target_norm)[:, None]


def _rms(x: Tensor, norm: _RMSNorm) -> Tensor:
    """``norm(x)`` without the module call, float32 inside as ``_RMSNorm`` (``F.rms_norm`` is several times slower
    on a CPU for one token: it decomposes into more ops)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight


def eagle_train_logits(head: EagleHead, backbone, features: Tensor, tokens: Tensor, valid: Tensor,
                       depth: int) -> Tensor:
    """Teacher-forced drafting from every position at once (EAGLE-3's training-time test): features [B, L, D]
    of the target, tokens [B, L] (token i + 1 at i), valid [B, L] bool -> logits [depth, B, L, V], where
    [t, b, i] is the draft for token i + 2 of a chain whose context ends at i - t (steps 1..t fed the head's
    own features and the tokens of the sequence), exactly what ``eagle_draft`` computes from that context
    with these tokens as drafts."""
    embed, norm, project = backbone_parts(backbone)
    batch, length = tokens.shape
    i = torch.arange(length, device=tokens.device)
    positions = i.expand(batch, length)
    e = embed(tokens)
    window = head.config.context
    keys = values = None
    inputs, out_logits = features, []
    offset = i[None, :] - i[:, None]  # [query i, key j] j - i
    for t in range(depth):
        # depth-0 keys j with i - t - window < j <= i - t (valid); depth-s keys (1 <= s <= t) at j = i - t + s
        parts = [_context_keys(offset, valid, t, window)]
        parts += [(offset == s - t).expand(batch, length, length) for s in range(1, t + 1)]
        mask = torch.cat(parts, dim=-1)[:, None]
        past = None if keys is None else (keys, values)
        out, k_new, v_new = head(inputs, e, positions, mask, past)
        keys = k_new if keys is None else torch.cat([keys, k_new], dim=2)
        values = v_new if values is None else torch.cat([values, v_new], dim=2)
        predicted = norm(out)  # [B, L, D]: f_{i+1} as chain depth t sees it
        out_logits.append(project(predicted))
        # position i reads the f_i predicted at i - 1 (position 0 has none: zeros, never a valid query)
        inputs = torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)
    return torch.stack(out_logits)


def dflash_draft(head: DFlashHead, backbone, features: Tensor, tokens: Tensor, valid: Tensor, k: int,
                 pick, done=None) -> tuple[Tensor, Tensor]:
    """``eagle_draft``'s arguments and result for a DFlash head: one head call on the context's C pairs and
    k - 1 slots gives all k drafts' logits; ``pick`` draws each draft (independently given the context),
    ``done`` as there (it only shortens the block: every logit is already computed)."""
    embed, norm, project = backbone_parts(backbone)
    rows, width = tokens.shape
    size = width + k - 1
    slot_features, slot_embeddings = head.slots(rows, k - 1)
    inputs = torch.cat([features, slot_features.to(features.dtype)], dim=1)
    embedded = torch.cat([embed(tokens), slot_embeddings.to(features.dtype)], dim=1)
    mask = _causal_mask(torch.cat([valid, valid.new_ones((rows, k - 1))], dim=1))
    positions = torch.arange(size, device=tokens.device).expand(rows, size)
    out = project(norm(head(inputs, embedded, positions, mask, last=k)))  # [R, k, V]
    logits, drafts = [], []
    finished = torch.zeros(rows, dtype=torch.bool, device=tokens.device)
    for j in range(k):
        logits.append(out[:, j])
        drafts.append(pick(logits[-1]))
        if done is not None:
            finished |= done(logits[-1], drafts[-1])
            if bool(finished.all()):
                break
    return torch.stack(logits, dim=1), torch.stack(drafts, dim=1)


def dflash_train_logits(head: DFlashHead, backbone, features: Tensor, tokens: Tensor, valid: Tensor,
                        depth: int) -> Tensor:
    """``eagle_train_logits`` for a DFlash head, in one pass: logits [depth, B, L, V] where [t, b, i] drafts
    token i + 2 as slot t of the block whose context ends at i - t (slot 0: the context's last pair),
    exactly what ``dflash_draft`` computes from that context. The pass holds the real pairs, then depth - 1
    copies of the slots at the same positions; slot t at i attends to the context window ending at i - t
    and to the slots 1..t of the same block (at i - t + s)."""
    embed, norm, project = backbone_parts(backbone)
    batch, length = tokens.shape
    i = torch.arange(length, device=tokens.device)
    offset = i[None, :] - i[:, None]  # [query i, key j] j - i
    window = head.config.context
    rows = []
    for t in range(depth):
        parts = [_context_keys(offset, valid, t, window)]
        parts += [(offset == s - t).expand(batch, length, length) & (s <= t) for s in range(1, depth)]
        rows.append(torch.cat(parts, dim=-1))
    mask = torch.cat(rows, dim=1)[:, None]  # [B, 1, depth L, depth L]
    slot_features, slot_embeddings = head.slots(batch, depth - 1, repeat=length)
    inputs = torch.cat([features, slot_features], dim=1)
    embedded = torch.cat([embed(tokens), slot_embeddings], dim=1)
    positions = i.repeat(depth).expand(batch, depth * length)
    out = head(inputs, embedded, positions, mask)
    return project(norm(out)).unflatten(1, (depth, length)).transpose(0, 1)


def dflash_from_eagle(eagle: EagleHead, layers: int = 1) -> DFlashHead:
    """A DFlash head warm-started from an EAGLE head: its input fusion and layer become the first layer
    (slot 0, the context's last pair, then drafts exactly as the EAGLE head's first step); the slots and any
    further layers start fresh."""
    head = DFlashHead(HeadConfig(**{**asdict(eagle.config), "kind": "dflash", "layers": layers}))
    state = {name.replace("block.", "blocks.0.", 1) if name.startswith("block.") else name: value
             for name, value in eagle.state_dict().items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    assert not unexpected and all(name == "slot" or name.startswith("blocks.") for name in missing)
    return head


def feature_draft(head, backbone, features, tokens, valid, k, pick, done=None) -> tuple[Tensor, Tensor]:
    """k drafts from the target's features with an EAGLE or a DFlash head (``eagle_draft``'s contract)."""
    draft = dflash_draft if isinstance(head, DFlashHead) else eagle_draft
    return draft(head, backbone, features, tokens, valid, k, pick, done)


def feature_train_logits(head, backbone, features, tokens, valid, depth) -> Tensor:
    """Training logits of an EAGLE or a DFlash head (``eagle_train_logits``'s contract)."""
    train = dflash_train_logits if isinstance(head, DFlashHead) else eagle_train_logits
    return train(head, backbone, features, tokens, valid, depth)


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


HEADS = {"eagle": EagleHead, "dflash": DFlashHead, "repair": RepairHead}


def new_head(config: HeadConfig) -> EagleHead | DFlashHead | RepairHead:
    """A freshly initialised head of ``config.kind``."""
    return HEADS[config.kind](config)


def save_head(head: EagleHead | DFlashHead | RepairHead, folder: str | Path, card: str | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (and ``README.md`` when ``card``) to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(head.config), indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if card is not None:
        (folder / "README.md").write_text(card)


def head_config(head) -> HeadConfig:
    """The config of a head module or of a head folder (without loading its weights); a shipped head's bare name
    (``"ar_eagle"``, ``"ar_repair"``) is its folder in ``dllm/weights``, from any working directory."""
    if isinstance(head, tuple(HEADS.values())):
        return head.config
    path = _folder(head) / "config.json"
    if not path.is_file():
        raise ValueError(f"draft_head must be a head module or a folder holding config.json; {path} not found")
    return HeadConfig(**json.loads(path.read_text()))


def load_head(head, device=None, dtype=None) -> EagleHead | DFlashHead | RepairHead:
    """A head module as it is, or the head saved in folder ``head`` (float32 unless ``dtype``, tensor by tensor into
    a meta-built head), in eval mode."""
    if isinstance(head, tuple(HEADS.values())):
        return head
    config = head_config(head)
    return load_saved(lambda: new_head(config), _folder(head), dtype=dtype or torch.float32, device=device).eval()


def _folder(head) -> Path:
    from .loading import shipped_or_path

    return shipped_or_path(head) if isinstance(head, str) else Path(head)


def check_head(head, kind: str | tuple[str, ...], backbone) -> HeadConfig:
    """A head of ``kind`` (or one of the kinds) whose width and vocabulary fit ``backbone``, or a ValueError
    naming draft_head."""
    config = head_config(head)
    kinds = (kind,) if isinstance(kind, str) else kind
    if config.kind not in kinds:
        wanted = " or ".join(repr(k) for k in kinds)
        raise ValueError(f"draft_head is a {config.kind!r} head; this drafter needs a {wanted} head "
                         f"(drafter='head' takes an 'eagle' or 'dflash' head, a diffusion drafter a 'repair' head)")
    backbone_parts(backbone)
    dim, vocab = backbone.config.dim, backbone.vocab_size
    if (config.dim, config.vocab_size) != (dim, vocab):
        raise ValueError(f"draft_head has dim {config.dim} and vocabulary {config.vocab_size}; its backbone has "
                         f"dim {dim} and vocabulary {vocab}")
    return config
