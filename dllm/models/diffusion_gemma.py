"""DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) as a block-causal DiffusionModel.

The checkpoint is an encoder-decoder over blocks with uniform noise and no mask token; see
``DiffusionGemmaAdapter`` for how it is given the masked-diffusion interface, and ``DiffusionGemmaCache`` for
the exact block cache of its causal encoder.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from transformers import DynamicCache

from dllm.counting import Counted, NativeLoop
from dllm.models.cache import SizedCache
from dllm.numerics import positions_from_mask
from dllm.protocols import Capabilities

from .hf import (
    _first_id,
    _HFAdapter,
    _padding_mask,
    select_rows,
)


class DiffusionGemmaCache(SizedCache):
    """DiffusionGemma's encoder cache of a prefix, with each row's padding mask and real-token count.

    It cannot roll back (sliding-window layers keep only their window), so ``croppable`` is False and
    speculative drafting with this model runs uncached.
    """

    croppable = False

    def __init__(self, config, kv: DynamicCache | None = None, key_mask: Tensor | None = None,
                 count: Tensor | None = None):
        self.config = config
        self.kv = kv if kv is not None else DynamicCache(config=config)
        self.key_mask = key_mask  # [B, P] long; None while empty
        self.count = count  # [B] real tokens cached per row

    def _sized_by(self) -> Tensor | None:
        return self.key_mask

    def encode(self, encoder, input_ids: Tensor, real: Tensor) -> None:
        """Append ``input_ids`` [B, n] (real tokens where ``real`` is 1) through the causal encoder."""
        count = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device) \
            if self.count is None else self.count
        key_mask = real if self.key_mask is None else torch.cat((self.key_mask, real), dim=1)
        positions = positions_from_mask(real, count)
        encoder(input_ids=input_ids, attention_mask=key_mask, position_ids=positions, cache=self.kv)
        self.key_mask, self.count = key_mask, count + real.sum(dim=1)

    def select(self, rows: Tensor) -> DiffusionGemmaCache:
        """A cache of the given rows (repeats allowed); layer objects are copied, their tensors indexed."""
        if self.key_mask is None:
            return DiffusionGemmaCache(self.config, count=torch.zeros(len(rows), dtype=torch.long,
                                                                       device=rows.device),
                                       key_mask=torch.zeros((len(rows), 0), dtype=torch.long, device=rows.device))
        return DiffusionGemmaCache(self.config, select_rows(self.kv, rows), self.key_mask[rows], self.count[rows])


class DiffusionGemmaAdapter(_HFAdapter):
    """DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) as a block-causal DiffusionModel.

    The checkpoint is an encoder-decoder over blocks ("canvases" of ``config.canvas_length`` tokens): a
    causal encoder reads everything before the active block; a bidirectional decoder denoises the active
    block against the encoder's keys/values, and later blocks are invisible to it. Its noise is uniform
    (random tokens), so it has no mask token. This adapter gives it the masked-diffusion interface:

    - ``mask_token_id`` is an extra id, ``config vocab_size``; ``vocab_size`` counts it (its logit is -inf).
    - ``block_size`` is the canvas length; samplers pass ``block_offset`` (the answer start), as for any
      block-causal model. Per row, the active block is the one holding the answer's first mask (the last
      block when there is none); the model reads masks, there and in a masked prompt (classifier-free
      guidance), as a fixed pseudo-random
      token of its position (seeded, so the model stays a deterministic function of the revealed tokens,
      which exact samplers need; the reference sampler draws fresh random tokens instead).
    - Logits cover the active block only; positions before it (revealed) and after it (invisible to the
      decoder) get all-zero logits. ``block_logits_only`` makes samplers' blocks nest inside the model's,
      so only fef's stale lookahead drafts read such logits (as uniform drafts: wasted, still exact).
    - Left padding: the encoder gets the padding mask and position ids counting real tokens, and the
      decoder ``decoder_attention_mask`` and positions continuing each row's count.
    Self-conditioning is not used. A plain call encodes each distinct prefix in it once. With the exact
    block cache (``new_cache`` / ``forward_cached``, used by the samplers' ``cache="auto"``) the encoder's
    keys/values of the prompt and of every finished block are computed once and reused: the encoder is
    causal, so they are exactly what a plain call computes.
    """

    cache_exact = True

    @property
    def capabilities(self) -> Capabilities:
        """Blocks of ``canvas_length`` with logits only inside them, an exact encoder cache, its own generate."""
        # needs_prompt: its encoder reads the tokens before the active block, so there must be some.
        # block_logits_only: samplers' blocks must nest inside the model's (samplers/options.py:
        # SamplerConfig.validate).
        # The cache neither crops nor drops (sliding-window layers keep only their window).
        return dataclasses.replace(super().capabilities, block_size=self.block_size, block_logits_only=True,
                                   needs_prompt=True, cache=True, cache_exact=self.cache_exact, native_loop=True)

    def __init__(self, model, tokenizer=None, mask_token_id: int | None = None, fill_seed: int = 0):
        super().__init__(model, tokenizer)
        text = getattr(model.config, "text_config", model.config)
        self.model_vocab_size = int(text.vocab_size)
        if mask_token_id not in (None, self.model_vocab_size):
            raise ValueError(f"DiffusionGemma has no mask token; its stand-in id is {self.model_vocab_size} "
                             f"(config vocab_size), got mask_token_id={mask_token_id!r}")
        self.mask_token_id = self.model_vocab_size
        self.vocab_size = self.model_vocab_size + 1
        self.block_size = int(model.config.canvas_length)
        generator = torch.Generator().manual_seed(fill_seed)
        self._fill = torch.randint(0, self.model_vocab_size, (1 << 16,), generator=generator)  # by position
        self._fills: dict[torch.device, Tensor] = {}  # the table on each device it was used on
        if self.eos_token_id is None:  # the top-level config names none; the text config does
            self.eos_token_id = _first_id(getattr(text, "eos_token_id", None))
            self.stop_token_ids = tuple(dict.fromkeys(i for i in (self.eos_token_id, *self.stop_token_ids)
                                                      if i is not None))

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                 block_offset: int | Tensor = 0) -> Tensor:
        """Clean-token logits of each row's active block (zeros elsewhere, -inf for the mask).  # [B, L, V + 1]"""
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        device, size = input_ids.device, self.block_size
        mask = _padding_mask(attention_mask, input_ids)
        real = torch.ones_like(input_ids) if mask is None else mask
        pads = (real == 0).sum(dim=1)
        positions = positions_from_mask(real)  # position-id coordinates: real tokens counted
        offset = torch.as_tensor(block_offset, device=device).expand(batch)
        # The active block holds the first mask of the answer (masks before it, e.g. the prompt of a
        # classifier-free-guidance call, are noise the encoder reads as filler tokens).
        is_mask = (input_ids == self.mask_token_id) & (positions >= offset[:, None]) & (real > 0)
        first = torch.where(is_mask.any(dim=1), is_mask.long().argmax(dim=1), length - 1)
        block_start = offset + torch.div(positions[torch.arange(batch), first] - offset, size,
                                         rounding_mode="floor") * size
        start = (block_start + pads).clamp(min=0)  # as an index
        # Encoder input: each row's tokens before its block, left-padded to a common length.
        prefix_len = int(start.max())
        column = torch.arange(prefix_len, device=device)
        source = column[None, :] - (prefix_len - start)[:, None]  # right-align each row's prefix
        inside = source >= 0
        source = source.clamp(min=0)
        enc_real = inside & (real.gather(1, source) > 0)
        if not bool(enc_real.any(dim=1).all()):
            raise ValueError("DiffusionGemmaAdapter needs at least one real token before each row's active "
                             "block (its encoder reads that prefix); give a prompt")
        enc_ids = self._canvas(torch.where(inside, input_ids.gather(1, source), 0), positions.gather(1, source))
        # Decoder input: the whole model block, masks (and positions past the input) as filler tokens.
        counted = enc_real.long().sum(dim=1)  # real prefix tokens per row
        slot = start[:, None] + torch.arange(size, device=device)[None, :]
        in_input = slot < length
        dec_pos = counted[:, None] + torch.arange(size, device=device)[None, :]
        dec_ids = self._canvas(torch.where(in_input, input_ids.gather(1, slot.clamp(max=length - 1)),
                                           self.mask_token_id), dec_pos)
        logits = self.model(
            cache=self._encode(enc_ids, enc_real), decoder_input_ids=dec_ids,
            decoder_attention_mask=torch.cat((enc_real, torch.ones_like(in_input)), dim=1).long(),
            decoder_position_ids=dec_pos,
        ).logits.float()  # [B, block_size, V]
        out = torch.zeros((batch, length, self.vocab_size), dtype=torch.float32, device=device)
        rows = torch.arange(batch, device=device)[:, None].expand_as(slot)
        out[rows[in_input], slot[in_input], : self.model_vocab_size] = logits[in_input]
        out[..., self.mask_token_id] = float("-inf")
        return out

    def _canvas(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """What the model reads: each mask replaced by its position's fixed filler token."""
        table = self._fills.get(tokens.device)
        if table is None:
            table = self._fills[tokens.device] = self._fill.to(tokens.device)
        return torch.where(tokens == self.mask_token_id, table[positions % table.numel()], tokens)

    def native_loop(self, prompt: Tensor, max_new_tokens: int, *, temperature: float,
                    attention_mask: Tensor | None = None, eos_token_id=None, **generate_kwargs) -> NativeLoop:
        """transformers' own DiffusionGemma sampler (``model.generate``), for ``sampler="native"``.

        It samples with its own temperature schedule (generation config ``t_min``/``t_max``, or
        ``generate_kwargs``), so ``temperature`` must stay at its default 1.0. Every encoder and decoder call
        is one model call (tokens = the call's input); each decoder call is a denoising step.
        """
        if temperature != 1.0:
            raise ValueError("sampler='native' uses DiffusionGemma's own temperature schedule (t_min, t_max in "
                             f"generate_kwargs); temperature must be 1.0, got {temperature}")
        inner = self.model.model
        device = self.device
        extra = {"attention_mask": attention_mask.to(device)} if attention_mask is not None else {}
        if eos_token_id is not None:
            extra["eos_token_id"] = list(eos_token_id)

        def run():
            return self.model.generate(input_ids=prompt.to(device), max_new_tokens=max_new_tokens, **extra,
                                       **generate_kwargs)

        pad = self.pad_token_id if self.pad_token_id is not None else 0
        counted = [Counted(inner.encoder), Counted(inner.decoder, key="decoder_input_ids", steps=True)]
        return NativeLoop(run, counted, "steps", pad, device)

    def new_cache(self) -> DiffusionGemmaCache:
        """An empty encoder cache for ``forward_cached``."""
        return DiffusionGemmaCache(self.config.get_text_config(decoder=True))

    @torch.inference_mode()
    def forward_cached(
        self,
        input_ids: Tensor,  # [N, n]
        cache: DiffusionGemmaCache,
        *,
        rows: Tensor | None = None,  # [N] cache row serving each input; only with append=False
        append: bool = True,
        attention_mask: Tensor | None = None,  # [N, cache.length + n] 0/1 over cached + new keys
        block_offset: int | Tensor | None = None,  # unused: inputs start at a block boundary (see below)
        position_ids: Tensor | None = None,
        commit: int = 0,
    ) -> Tensor:
        """The protocol's cached call, for the exact block cache: ``append=True`` encodes finished tokens
        (prompt, a finished block; no masks) into the cache and returns zero logits; ``append=False`` decodes
        the block the inputs start with (the active block; later positions, e.g. a lookahead block, get
        zero logits) against the cache rows ``rows``.  # [N, n, V + 1]
        """
        if position_ids is not None or commit:
            raise ValueError("DiffusionGemmaAdapter.forward_cached takes neither position_ids nor commit")
        input_ids = input_ids.to(self.device)
        n_inputs, length = input_ids.shape
        new_real = torch.ones_like(input_ids) if attention_mask is None else \
            attention_mask[:, attention_mask.shape[1] - length:].to(input_ids.device).long()
        out = torch.zeros((n_inputs, length, self.vocab_size), dtype=torch.float32, device=input_ids.device)
        out[..., self.mask_token_id] = float("-inf")
        if append:
            if rows is not None:
                raise ValueError("forward_cached: rows= reads shared cache rows and cannot append")
            if bool((input_ids == self.mask_token_id).any()):
                raise ValueError("DiffusionGemmaAdapter caches finished tokens only; the inputs hold masks")
            cache.encode(self.model.model.encoder, input_ids, new_real)
            return out
        past = cache if rows is None else cache.select(rows.to(input_ids.device))
        size, width = self.block_size, min(self.block_size, length)
        block = torch.full((n_inputs, size), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        block[:, :width] = input_ids[:, :width]  # a short last block is filled up with filler tokens
        positions = past.count[:, None] + torch.arange(size, device=input_ids.device)[None, :]
        logits = self.model(cache=past.kv, decoder_input_ids=self._canvas(block, positions),
                            decoder_attention_mask=torch.cat((past.key_mask, torch.ones_like(block)), dim=1),
                            decoder_position_ids=positions).logits.float()
        out[:, :width, : self.model_vocab_size] = logits[:, :width]
        return out

    def _encode(self, enc_ids: Tensor, enc_real: Tensor) -> DynamicCache:
        """The encoder's cache of each row's prefix [B, P], running the encoder once per distinct prefix
        (fef's verification copies of a row share theirs), then indexing its rows out per input."""
        cache = DynamicCache(config=self.config.get_text_config(decoder=True))
        if enc_ids.shape[1] == 0:
            return cache
        distinct, inverse = torch.unique(torch.cat((enc_ids, enc_real.long()), dim=1), dim=0, return_inverse=True)
        ids, real = distinct[:, : enc_ids.shape[1]], distinct[:, enc_ids.shape[1]:]
        self.model.model.encoder(input_ids=ids, attention_mask=real, position_ids=positions_from_mask(real),
                                 cache=cache)
        if len(distinct) == len(enc_ids) and torch.equal(inverse, torch.arange(len(inverse), device=inverse.device)):
            return cache
        return select_rows(cache, inverse)
