"""A prefix-conditioned two-stream layout over TransformerLM's weights: the exact chain has a KV cache.

Two kinds of tokens go through the same layers (XLNet's two-stream attention, the any-subset
autoregressive models of Guo and Ermon; no code taken from either):

- the *content stream*: revealed tokens at their true positions (rotary), processed causally in the
  order they were revealed (the prompt first, in order). Content token i attends to content 0..i, so its
  keys/values never change once computed and are cached exactly as an autoregressive model's.
- the *query stream*: one mask-token input per masked position that is read, at that position. A query
  attends to a prefix of the content stream (cache plus the first ``sees`` content tokens of the call)
  and to itself, never to other queries; its logits score the token at its position given that prefix.

So the chain ``sequential`` samples (reveal one position, append its token to the content stream, query
again) is the product of query conditionals, and a fef window's prefix conditionals (query j sees
drafts d_<j) come from ONE call of W content tokens plus W(+1) queries: the very computation the chain
makes step by step, so one-pass verification is exact (``Capabilities.one_pass_exact``).

The plain ``DiffusionModel`` call reads a canvas's revealed tokens in position order (the reveal order
of left-to-right decoding) and queries every position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from einops import rearrange
from torch import Tensor, nn

from dllm.models.cache import RevealCache
from dllm.models.transformer import TransformerLM
from dllm.numerics import positions_from_mask
from dllm.protocols import Capabilities, sampler_defaults_record

MARKER = "two_stream.json"  # beside config.json: the folder holds a TwoStreamLM, not a plain TransformerLM


class TwoStreamLM(nn.Module):
    """A TransformerLM's layers run as content and query streams; see the module docstring."""

    def __init__(self, base: TransformerLM, block_size: int | None = None,
                 sampler_defaults: dict[str, dict] | None = None):
        super().__init__()
        self.base = base
        # The blocks it was trained to decode in (samplers' default block_length); none in its attention.
        self.block_size = base.config.block_size if block_size is None else block_size
        # {sampler: {option: value, "when": {option: value}}} measured fastest on this model (two_stream.json;
        # Capabilities.sampler_defaults): the table applies only while the "when" options hold
        self.sampler_defaults = {name: dict(values) for name, values in (sampler_defaults or {}).items()}
        self.config = base.config
        self.vocab_size, self.mask_token_id = base.vocab_size, base.config.mask_token_id
        if self.mask_token_id is None:
            raise ValueError("TwoStreamLM needs a base model with a mask_token_id (the query stream's input)")
        self.eos_token_id, self.pad_token_id = base.eos_token_id, base.pad_token_id

    @property
    def capabilities(self) -> Capabilities:
        """Padding, features (draft heads) and the reveal-order cache with its one-pass exact verifier."""
        return Capabilities(accepts_attention_mask=True, context_length=self.config.max_seq_len,
                            block_size=self.block_size, reveal_order_cache=True, one_pass_exact=True,
                            hidden_states=True, logits_at=True,
                            sampler_defaults=sampler_defaults_record(self.sampler_defaults, MARKER))

    @property
    def context_length(self) -> int:
        return self.config.max_seq_len

    def new_cache(self, batch: int) -> RevealCache:
        return RevealCache(batch)

    def streams(
        self,
        content_ids: Tensor,  # [R, C] in reveal order
        content_pos: Tensor,  # [R, C] true positions
        content_valid: Tensor,  # [R, C] bool; invalid entries are seen by no one
        query_pos: Tensor,  # [R, Q] positions read
        query_sees: Tensor,  # [R, Q] content tokens of this call each query attends to (a prefix)
        cache: RevealCache | None = None,
        rows: Tensor | None = None,  # [R] cache rows (default all)
        append: bool = False,
        hidden: bool = False,
        content_sees: Tensor | None = None,  # [R, C] content i sees this call's j < content_sees[i] (default i + 1)
        content_extra: Tensor | None = None,  # [R, C, 2] a range [start, stop) of this call's content it also sees
        query_extra: Tensor | None = None,  # [R, Q, 2] likewise for a query (start >= stop: none)
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Query logits [R, Q, V]: the token at query_pos given cache + content[:sees]; with ``append`` the
        content's keys/values join the cache (tentatively: ``RevealCache.keep`` drops rejected ones).
        ``hidden``: ``(logits, features [R, Q, dim])``, the final-normed query states (a draft head's input).

        A draft tree (samplers/fef/two_stream.py) puts the branch of a sibling of draft d_j after the chain: its
        tokens see the content before d_j (``content_sees``) and the branch before them (``content_extra``), so
        the branch is revealed right after d_<j; its queries see the same prefix and branch (``query_extra``)."""
        n, width = content_ids.shape
        if rows is None:
            rows = torch.arange(n, device=content_ids.device)
        past = cache.rows(rows) if cache is not None else None
        tokens = torch.cat([content_ids, torch.full_like(query_pos, self.mask_token_id)], dim=1)
        positions = torch.cat([content_pos, query_pos], dim=1)
        mask = _stream_mask(content_valid, query_sees, content_sees, content_extra, query_extra)  # [R, C + Q, C + Q]
        if past is not None and past.length:
            mask = torch.cat([past.valid[:, None, :].expand(-1, mask.shape[1], -1), mask], dim=2)
        h, new_kv = self.base.layer_states(tokens, positions, rearrange(mask, "b q k -> b 1 q k"), past, keep=append)
        if append:
            if cache is None:
                raise ValueError("streams(append=True) needs a cache")
            cache.extend(rows, [(k[:, :, :width], v[:, :, :width]) for k, v in new_kv], content_pos, content_valid)
        return self.base.head(h[:, width:], hidden=hidden)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, block_offset=None,
                return_hidden: bool = False, logits_at: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The DiffusionModel call: revealed tokens in position order, a query at every position.  # [B, L, V]

        attention_mask: [B, L] 0/1 left padding (positions then start at each row's first real token).
        block_offset: accepted and unused (no block mask here: blocks only steer the samplers' order).
        return_hidden: ``(logits, features)`` as ``TransformerLM.forward``.
        logits_at: [B, K] positions: queries there only (``dllm.protocols``), logits in the model's dtype.
        """
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = positions_from_mask(real)
        revealed = real & (input_ids != self.mask_token_id)
        # Query at i sees the revealed tokens at positions < i and > i alike: all of them.
        queries = positions if logits_at is None else positions.gather(1, logits_at)
        sees = torch.full_like(queries, input_ids.shape[1])
        out = self.streams(input_ids, positions, revealed, queries, sees, hidden=return_hidden)
        if logits_at is None:
            return out
        # streams() gives float32 query logits; the protocol's logits_at answer is in the model's dtype
        dtype = self.base.output.weight.dtype
        return (out[0].to(dtype), out[1]) if return_hidden else out.to(dtype)

    def save_pretrained(self, folder: str | Path) -> None:
        """The base's files plus the two-stream marker."""
        self.base.save_pretrained(folder)
        marker = {"layout": "two_stream", "block_size": self.block_size}
        if self.sampler_defaults:
            marker["sampler_defaults"] = self.sampler_defaults
        (Path(folder) / MARKER).write_text(json.dumps(marker) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path, device=None, dtype=None) -> TwoStreamLM:
        """Load a saved TwoStreamLM, or wrap any TransformerLM folder (e.g. the diffusion model, as an init)."""
        marker = Path(folder) / MARKER
        values = json.loads(marker.read_text()) if marker.exists() else {}
        defaults = values.get("sampler_defaults") or {}
        sampler_defaults_record(defaults, str(marker))  # checked here, where the file is named
        return cls(TransformerLM.from_pretrained(folder, device=device, dtype=dtype), values.get("block_size"),
                   defaults).eval()


def is_two_stream_folder(folder: str | Path) -> bool:
    """Whether ``folder`` was saved by ``TwoStreamLM.save_pretrained``."""
    return (Path(folder) / MARKER).exists()


def _stream_mask(content_valid: Tensor, query_sees: Tensor, content_sees: Tensor | None = None,
                 content_extra: Tensor | None = None, query_extra: Tensor | None = None) -> Tensor:
    """Who attends to whom among this call's tokens (True = attend).  # [R, C + Q, C + Q]

    Content i sees valid content j <= i (j < content_sees[i] when given) and j in the range content_extra[i]
    (when given); query q sees valid content j < sees[q], j in the range query_extra[q] (when given) and
    itself. Every token sees itself, so no row of the mask is empty (invalid entries' outputs are never read).
    """
    n, width = content_valid.shape
    num_queries = query_sees.shape[1]
    j = torch.arange(width, device=content_valid.device)
    if content_sees is None:
        content_rows = (j[None, :, None] >= j[None, None, :]) & content_valid[:, None, :]  # [R, C, C]
    else:
        content_rows = (j[None, None, :] < content_sees[:, :, None]) & content_valid[:, None, :]
    if content_extra is not None:
        content_rows |= _in_range(j, content_extra) & content_valid[:, None, :]
    query_rows = (j[None, None, :] < query_sees[:, :, None]) & content_valid[:, None, :]  # [R, Q, C]
    if query_extra is not None:
        query_rows |= _in_range(j, query_extra) & content_valid[:, None, :]
    eye_c = torch.eye(width, dtype=torch.bool, device=content_valid.device).expand(n, -1, -1)
    eye_q = torch.eye(num_queries, dtype=torch.bool, device=content_valid.device).expand(n, -1, -1)
    top = torch.cat([content_rows | eye_c, torch.zeros(n, width, num_queries, dtype=torch.bool,
                                                       device=content_valid.device)], dim=2)
    bottom = torch.cat([query_rows, eye_q], dim=2)
    return torch.cat([top, bottom], dim=1)


def _in_range(j: Tensor, ranges: Tensor) -> Tensor:
    """Whether content index j [C] lies in each range [start, stop) of ``ranges`` [R, N, 2] -> [R, N, C]."""
    return (j[None, None, :] >= ranges[..., :1]) & (j[None, None, :] < ranges[..., 1:])
