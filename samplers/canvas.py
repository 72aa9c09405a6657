"""The state shared by the masked-diffusion samplers: the token canvas and its block schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.stats import DecodeStats


@dataclass
class Canvas:
    """Prompt plus a masked answer region, decoded block by block (semi-autoregressively).

    ``x`` [B, P + N] holds the prompt and the answer; answer positions are split into blocks of
    ``block_length``. A row's active block is the block of its leftmost masked answer position, so rows
    may sit in different blocks when they accept different numbers of tokens.
    """

    x: torch.Tensor  # [B, L]
    prompt_length: int
    block_length: int
    mask_token_id: int

    @classmethod
    def start(cls, prompt: torch.Tensor, gen_length: int, block_length: int, mask_token_id: int) -> Canvas:
        answer = torch.full((prompt.shape[0], gen_length), mask_token_id, dtype=torch.long, device=prompt.device)
        return cls(torch.cat([prompt.long(), answer], dim=1), prompt.shape[1], block_length, mask_token_id)

    @property
    def block_ids(self) -> torch.Tensor:
        """[L] block index of every position; -1 on the prompt."""
        positions = torch.arange(self.x.shape[1], device=self.x.device) - self.prompt_length
        return torch.where(positions >= 0, positions // self.block_length, torch.full_like(positions, -1))

    @property
    def num_blocks(self) -> int:
        return (self.x.shape[1] - self.prompt_length) // self.block_length

    def active_rows(self) -> torch.Tensor:
        """Indices of rows with masked positions left -> [R]."""
        return (self.x == self.mask_token_id).any(dim=1).nonzero().squeeze(-1)

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """Masked positions of each row's active block in ``x`` [R, L] -> bool [R, L]."""
        return block_candidates(x, self.block_ids, self.mask_token_id)


def block_candidates(x: torch.Tensor, block_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Masked positions inside each row's active block (that of its leftmost masked position) -> [R, L]."""
    masked = x == mask_token_id
    big = torch.iinfo(torch.long).max
    active = torch.where(masked, block_ids, torch.full_like(x, big)).min(dim=1).values  # [R]
    return masked & (block_ids[None, :] == active[:, None])


def call_model(
    model, input_ids: torch.Tensor, stats: DecodeStats, draft: bool = False, rows: int | None = None
) -> torch.Tensor:
    """One counted model call serving ``rows`` sequences: ``input_ids`` [N, L] -> logits [N, L, V]."""
    stats.count_call(input_ids, draft=draft, rows=rows)
    logits = model(input_ids)
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input_ids {tuple(input_ids.shape)}; "
            "expected [B, L, V]"
        )
    return logits


def masked_logits(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Logits with the mask token forbidden, as float32 or wider -> same shape."""
    out = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
    if mask_token_id < out.shape[-1]:
        out[..., mask_token_id] = float("-inf")
    return out
