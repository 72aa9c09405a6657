"""Training examples and the model inputs of each objective.

Data order is a pure function of ``(seed, step)``: step s draws the first ``batch_size`` problems of
``training_stream(derive_seed(seed, "data", s))``, and process r of W takes problems ``r::W`` (disjoint
shards whose union is the batch a single process would see). Masking noise is seeded the same way, so a
resumed run replays exactly without saving iterator state.

An example is the prompt ``"Question: ...\\nAnswer:"`` (never a target) and an answer region: the
tokens of ``" " + answer``, one EOS, then EOS padding (LLaDA's SFT recipe, so a diffusion model learns to
fill the rest of its canvas with EOS; decoding cuts at the first EOS). Region length per layout:

- ``causal``: answer + one EOS (next-token loss on exactly those; the question is random and is
  never scored at inference, so it is not a target);
- ``bidirectional``: a fixed ``answer_length`` (the canvas ``max_new_tokens`` to decode with);
- ``block_causal``: answer + EOS rounded up to whole blocks, plus one all-EOS block, so the model also
  learns that the block after the end is EOS (later blocks never see the canvas length).

Block anchor (block_causal only, ``train.block_anchor``): ``"answer"`` (the default) starts blocks at the
answer; ``"absolute"`` starts them at position 0, as SDAR does (the prompt is block-causal too, and the
first answer block may begin inside the prompt's last block). With ``"absolute"`` the region ends at a
block boundary in absolute positions (prompt + answer + EOS rounded up to whole blocks, plus one all-EOS
block), and the noisy stream starts at the block holding the answer's first token: that block's prompt
tokens ride in it clean (never masked, never targets) beside its maskable answer tokens.

Masking (both diffusion layouts): per group of n region positions (the whole region for bidirectional,
each block for block_causal) draw t ~ U(0, 1], mask exactly k = ceil(t n) positions uniformly at random
and weight their cross-entropy by n / k = 1/t. This is the discrete form of the MDLM/LLaDA 1/t-weighted
ELBO (the any-order autoregressive bound), without empty masks and with weights bounded by n.
``train.suffix_mask_prob`` makes that share of groups mask their last k positions instead (the states
left-to-right decoding visits; the estimate is then no longer the plain ELBO). Masking noise is seeded by
(seed, step, process, micro-batch), so it depends on the number of processes (the data does not).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor

from dllm.data.synthetic import ProblemConfig, format_example, training_stream

IGNORE = -100
BLOCK_ANCHORS = ("answer", "absolute")  # where block_causal blocks start (Capabilities.block_anchor)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of values (stable across runs and Python hash seeds)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class Example:
    """One tokenized problem: prompt ids and the answer-region ids (answer, EOS, EOS padding)."""

    prompt: tuple[int, ...]
    region: tuple[int, ...]
    answer_tokens: int  # answer + the first EOS; the rest of the region is padding


@dataclass
class Batch:
    """Model inputs and weighted targets for one forward.

    ``loss = sum(weights * CE(logits, targets)) / count``, summed over all positions whose target is not
    IGNORE; ``count`` (the answer-region tokens) is the normaliser, so the loss is a per-token bound.
    """

    input_ids: Tensor  # [B, L]
    attention_mask: Tensor  # [B, L] 0/1 padding, or bool [B, L, L] (True = attend)
    position_ids: Tensor | None  # [B, L]
    block_offset: Tensor | int  # [B] answer start per row (block_causal, answer anchor), else 0
    targets: Tensor  # [B, L] token ids or IGNORE
    weights: Tensor  # [B, L] float32, 0 where IGNORE
    count: int  # answer-region tokens in the batch (the loss normaliser)


def region_length(layout: str, answer_tokens: int, block_size: int | None, answer_length: int,
                  prompt_tokens: int = 0, anchor: str = "answer") -> int:
    """How many region positions an answer of ``answer_tokens`` (EOS included) gets in ``layout``; with the
    ``"absolute"`` block anchor the region ends at a block boundary counted from position 0 (the prompt's
    ``prompt_tokens`` come first)."""
    if layout == "causal":
        return answer_tokens
    if layout == "bidirectional":
        return answer_length
    if anchor == "absolute":
        end = math.ceil((prompt_tokens + answer_tokens) / block_size) * block_size + block_size
        return end - prompt_tokens
    return math.ceil(answer_tokens / block_size) * block_size + block_size


def tokenize_problems(problems: list[dict[str, str]], tokenizer, layout: str, block_size: int | None,
                      answer_length: int, anchor: str = "answer") -> list[Example]:
    """Examples for ``problems``; prompt and answer are tokenized apart exactly as at inference."""
    _check_anchor(anchor, layout)
    prompts = tokenizer([format_example(p["question"]) for p in problems], add_special_tokens=False)
    answers = tokenizer([" " + p["answer"] for p in problems], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    examples = []
    for prompt, answer in zip(prompts["input_ids"], answers["input_ids"]):
        n = len(answer) + 1
        size = region_length(layout, n, block_size, answer_length, len(prompt), anchor)
        if size < n:
            raise ValueError(f"an answer of {n} tokens (EOS included) exceeds data.answer_length={answer_length}")
        examples.append(Example(tuple(prompt), tuple(answer) + (eos,) * (size - len(answer)), n))
    return examples


def step_problems(seed: int, step: int, batch_size: int, rank: int, world: int,
                  preset: ProblemConfig) -> list[dict[str, str]]:
    """This process's share of step ``step``'s batch: problems ``rank::world`` of the global batch."""
    stream = training_stream(derive_seed(seed, "data", step), preset)
    return list(islice(stream, batch_size))[rank::world]


def micro_batches(examples: list[Example], size: int) -> list[list[Example]]:
    """Split into chunks of ``size`` after a stable sort by length, so each chunk pads little."""
    ordered = sorted(examples, key=lambda e: (len(e.prompt) + len(e.region), len(e.region)))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def _check_anchor(anchor: str, layout: str) -> None:
    if anchor not in BLOCK_ANCHORS:
        raise ValueError(f"block anchor must be one of {list(BLOCK_ANCHORS)}, got {anchor!r}")
    if anchor != "answer" and layout != "block_causal":
        raise ValueError(f"block anchor {anchor!r} is for layout='block_causal', got layout={layout!r}")


def build_batch(layout: str, examples: list[Example], *, pad_id: int, mask_id: int | None,
                block_size: int | None, generator: torch.Generator, suffix_prob: float = 0.0,
                anchor: str = "answer") -> Batch:
    """The objective's inputs for ``examples``: next-token, masked diffusion, or two-stream block diffusion
    (blocks anchored at the answer, or at position 0 with ``anchor="absolute"``)."""
    _check_anchor(anchor, layout)
    if layout == "causal":
        return _causal_batch(examples, pad_id)
    if layout == "bidirectional":
        return _masked_batch(examples, pad_id, mask_id, generator, suffix_prob)
    return _two_stream_batch(examples, pad_id, mask_id, block_size, generator, suffix_prob, anchor)


def _right_pad(rows: list[list[int]], value: int) -> Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def _causal_batch(examples: list[Example], pad_id: int) -> Batch:
    """[prompt, answer, EOS]; logits at i score token i + 1, targets are the answer and its EOS."""
    rows = [list(e.prompt + e.region) for e in examples]
    input_ids = _right_pad(rows, pad_id)
    targets = torch.full_like(input_ids, IGNORE)
    for i, e in enumerate(examples):
        start = len(e.prompt)
        targets[i, start - 1:start - 1 + len(e.region)] = input_ids[i, start:start + len(e.region)]
    valid = _right_pad([[1] * len(r) for r in rows], 0)
    return Batch(input_ids, valid, None, 0, targets, (targets != IGNORE).float(),
                 sum(len(e.region) for e in examples))


def mask_groups(regions: Tensor, group: int, generator: torch.Generator,
                suffix_prob: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per group of ``group`` positions, pick k = ceil(t n) to mask, t ~ U(0, 1].  # [B, R] -> 2 x [B, R]

    ``regions`` [B, R] marks real region positions (R a multiple of ``group``; padding groups are all
    False and get no mask). With probability ``suffix_prob`` a group masks its last k positions instead
    of k random ones: the states that left-to-right decoding visits. Returns (masked bool [B, R],
    weight n / k float32 [B, R] on masked positions).
    """
    b, r = regions.shape
    n = regions.view(b, r // group, group).sum(-1)  # [B, G] real positions per group
    t = 1.0 - torch.rand(b, r // group, generator=generator, dtype=torch.float64)  # (0, 1]
    k = torch.ceil(t * n).long().clamp(max=n)  # [B, G]
    scores = torch.rand(b, r // group, group, generator=generator)
    if suffix_prob > 0:  # drawn only when used, so suffix_prob = 0 replays earlier runs exactly
        suffix = torch.rand(b, r // group, 1, generator=generator) < suffix_prob
        scores = torch.where(suffix, -torch.arange(group, dtype=scores.dtype) / group, scores)
    scores = scores.masked_fill(~regions.view(b, r // group, group), 2.0)  # padding ranks last
    rank = scores.argsort(-1).argsort(-1)  # [B, G, group] rank of each position in its group
    masked = (rank < k[..., None]) & regions.view(b, r // group, group)
    weight = n.double() / k.clamp(min=1).double()
    weights = torch.where(masked, weight[..., None], 0.0).float()
    return masked.view(b, r), weights.view(b, r)


def _masked_batch(examples: list[Example], pad_id: int, mask_id: int, generator, suffix_prob: float) -> Batch:
    """LLaDA-style SFT: [prompt, masked region]; targets are the clean tokens at masked positions."""
    region = torch.tensor([e.region for e in examples], dtype=torch.long)  # [B, R], R = answer_length
    masked, weights = mask_groups(torch.ones_like(region, dtype=torch.bool), region.shape[1], generator,
                                  suffix_prob)
    noisy = torch.where(masked, mask_id, region)
    rows = [list(e.prompt) + noisy[i].tolist() for i, e in enumerate(examples)]
    input_ids = _right_pad(rows, pad_id)
    targets, full_weights = torch.full_like(input_ids, IGNORE), torch.zeros(input_ids.shape)
    for i, e in enumerate(examples):
        span = slice(len(e.prompt), len(e.prompt) + region.shape[1])
        targets[i, span] = torch.where(masked[i], region[i], IGNORE)
        full_weights[i, span] = weights[i]
    valid = _right_pad([[1] * len(r) for r in rows], 0)
    return Batch(input_ids, valid, None, 0, targets, full_weights, region.numel())


def _two_stream_batch(examples: list[Example], pad_id: int, mask_id: int, block_size: int, generator,
                      suffix_prob: float, anchor: str = "answer") -> Batch:
    """BD3-LM-style input [noisy span ; prompt, clean region] with the attention of block decoding.

    Noisy block b attends to itself and to clean blocks < b (the prompt's blocks included); clean tokens
    attend block-causally among clean tokens. The noisy copy reuses the clean positions, so its logits
    equal those of the inference call on [prompt, clean blocks < b, noisy block b] (block_offset = prompt
    length for ``anchor="answer"``, 0 for ``"absolute"``). The noisy span is the region, preceded for
    ``"absolute"`` by the ``lead`` = prompt length mod block_size prompt tokens that share the answer's
    first block (clean, never targets). Loss on the noisy stream's masked positions only.
    """
    leads = [len(e.prompt) % block_size if anchor == "absolute" else 0 for e in examples]
    spans = [lead + len(e.region) for lead, e in zip(leads, examples)]
    if any(span % block_size for span in spans):
        raise ValueError(f"two-stream regions must fill whole blocks of {block_size} ({anchor!r} anchor)")
    regions = torch.zeros(len(examples), max(spans), dtype=torch.bool)  # maskable positions of each span
    for i, (lead, span) in enumerate(zip(leads, spans)):
        regions[i, lead:span] = True
    masked, weights = mask_groups(regions, block_size, generator, suffix_prob)
    rows, positions, streams, target_rows, weight_rows = [], [], [], [], []
    for i, (e, lead, s) in enumerate(zip(examples, leads, spans)):
        p, r = len(e.prompt), len(e.region)
        clean = e.prompt[p - lead:] + e.region  # the span's clean tokens
        hidden = masked[i, :s].tolist()
        rows.append([mask_id if m else tok for tok, m in zip(clean, hidden)] + list(e.prompt + e.region))
        positions.append(list(range(p - lead, p + r)) + list(range(p + r)))
        streams.append([1] * s + [2] * (p + r))
        target_rows.append([tok if m else IGNORE for tok, m in zip(clean, hidden)] + [IGNORE] * (p + r))
        weight_rows.append(weights[i, :s].tolist() + [0.0] * (p + r))
    input_ids, position_ids = _right_pad(rows, pad_id), _right_pad(positions, 0)
    stream = _right_pad(streams, 0)  # 0 padding, 1 noisy, 2 clean
    offsets = torch.tensor([0 if anchor == "absolute" else len(e.prompt) for e in examples])
    mask = two_stream_mask(position_ids, stream, offsets, block_size)
    weights_full = torch.tensor([w + [0.0] * (input_ids.shape[1] - len(w)) for w in weight_rows])
    return Batch(input_ids, mask, position_ids, offsets, _right_pad(target_rows, IGNORE), weights_full,
                 sum(len(e.region) for e in examples))


def two_stream_mask(position_ids: Tensor, stream: Tensor, block_offset: Tensor, block_size: int) -> Tensor:
    """Attention of the two-stream input (True = attend).  # position_ids, stream [B, L] -> [B, L, L]

    ``stream``: 0 padding, 1 noisy, 2 clean. Blocks start at ``block_offset + k * block_size``.
    """
    block = torch.div(position_ids - block_offset[:, None], block_size, rounding_mode="floor")
    q_block, k_block = block[:, :, None], block[:, None, :]
    q_noisy, k_noisy = (stream == 1)[:, :, None], (stream == 1)[:, None, :]
    q_clean, k_clean = (stream == 2)[:, :, None], (stream == 2)[:, None, :]
    return ((q_clean & k_clean & (k_block <= q_block))
            | (q_noisy & k_noisy & (k_block == q_block))
            | (q_noisy & k_clean & (k_block < q_block)))


def batch_tokens(batch: Batch) -> int:
    """Real (non-padding) input tokens in a batch, for throughput."""
    if batch.attention_mask.dim() == 2:
        return int(batch.attention_mask.sum())
    return int(batch.attention_mask.any(-1).sum())
