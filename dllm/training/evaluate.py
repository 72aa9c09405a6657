"""Held-out accuracy of a trained model with ``dllm.generate``: exact match of the ``#### N`` answer.

Prompts of equal token length are batched together (no padding needed). A completion is cut at the first
EOS, decoded, and its last line ``#### N`` compared with the reference's. Block-causal models are called
with ``block_offset`` = the prompt length, so their blocks start at the answer, as in training, unless
they declare ``Capabilities.block_anchor == "absolute"`` (SDAR: blocks from position 0), which
``generate`` then handles itself.

``generate`` has no EOS stopping, so decoding runs in chunks of ``chunk`` tokens (the run's block size for
block-causal models, ``dllm.protocols.run_block_size``; for an absolute anchor the first chunk runs only to the
end of the prompt's last model block, so every chunk is whole model blocks) and rows that have emitted EOS leave
the batch. For causal and block-causal models this is the same computation as one call (neither looks past the
current block), so greedy outputs are identical; a bidirectional model sees its whole canvas, so it is decoded
in one call.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from dllm.data.calc import final_answer
from dllm.data.synthetic import format_example, heldout_set
from dllm.protocols import capabilities, run_block_size


class AnswerAligned:
    """A block-causal TransformerLM seen as a plain DiffusionModel whose blocks start at ``prompt_length``."""

    def __init__(self, model, prompt_length: int):
        self.model, self.prompt_length = model, prompt_length
        self.mask_token_id, self.vocab_size = model.mask_token_id, model.vocab_size

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        return self.model(input_ids, block_offset=self.prompt_length)


def default_sampler(model) -> tuple[str, dict[str, Any]]:
    """The reference decoding of a layout: greedy ``ar``, or ``sequential`` left to right per block."""
    if model.config.layout == "causal":
        return "ar", {}
    block = model.config.block_size
    return "sequential", {"order": "left_to_right", **({"block_length": block} if block else {})}


@torch.no_grad()
def heldout_accuracy(model, tokenizer, sampler: str, *, limit: int = 500, max_new_tokens: int = 80,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 64, dtype: torch.dtype | None = None,
                     progress: bool = False, **options: Any) -> dict[str, Any]:
    """Accuracy on the first ``limit`` held-out problems; returns accuracy, counts, stats and examples."""
    problems = heldout_set()[:limit]
    prompts = tokenizer([format_example(p["question"]) for p in problems], add_special_tokens=False)["input_ids"]
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        groups[len(prompt)].append(index)
    batches = [ids[i:i + batch_size] for _, ids in sorted(groups.items()) for i in range(0, len(ids), batch_size)]
    completions: dict[int, str] = {}
    totals = {"nfe": 0, "nfe_draft": 0, "row_calls": 0, "forward_tokens": 0, "new_tokens": 0, "wall_time_s": 0.0}
    autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    for n, ids in enumerate(batches):
        generator = torch.Generator().manual_seed(seed + n)
        with autocast:
            rows = generate_until_eos(model, torch.tensor([prompts[i] for i in ids]), sampler, max_new_tokens,
                                      tokenizer.eos_token_id, totals, temperature=temperature,
                                      generator=generator, **options)
        completions.update({i: decode_completion(row, tokenizer) for i, row in zip(ids, rows)})
        if progress:
            print(f"\r{len(completions)}/{len(problems)}", end="", flush=True)
    correct = [final_answer(completions[i].strip()) == final_answer(p["answer"]) for i, p in enumerate(problems)]
    return {"accuracy": sum(correct) / len(problems), "correct": sum(correct), "n": len(problems),
            "sampler": sampler, "options": options, "temperature": temperature, "max_new_tokens": max_new_tokens,
            **totals, "examples": [{"question": problems[i]["question"], "completion": completions[i],
                                    "correct": correct[i]} for i in range(min(3, len(problems)))]}


def generate_until_eos(model, prompt: torch.Tensor, sampler: str, max_new_tokens: int, eos_token_id: int,
                       totals: dict[str, float], **kwargs: Any) -> list[list[int]]:
    """Decode ``prompt`` [B, P] chunk by chunk until every row has an EOS; new ids per row (ragged).

    Adds each call's DecodeStats fields named in ``totals`` (e.g. ``nfe``, ``new_tokens``) to it.
    """
    import dllm  # the front door; imported here so the training modules stay on the ground floor

    layout, block = model.config.layout, run_block_size(model, kwargs.get("block_length"))  # the run's blocks
    whole = layout == "bidirectional" or capabilities(model).reveal_order_cache  # two-stream: its cache keeps the order
    chunk = max_new_tokens if whole else (block or 8)
    absolute = layout == "block_causal" and capabilities(model).block_anchor == "absolute"
    aligned = layout == "block_causal" and not whole and not absolute
    target = AnswerAligned(model, prompt.shape[1]) if aligned else model
    first = chunk - prompt.shape[1] % chunk if absolute and not whole else chunk  # to the model block's end
    seq, active = prompt, torch.arange(prompt.shape[0])
    new: list[list[int]] = [[] for _ in range(prompt.shape[0])]
    while active.numel() and len(new[int(active[0])]) < max_new_tokens:
        done = len(new[int(active[0])])
        size = min(first if done == 0 else chunk, max_new_tokens - done)
        out = dllm.generate(target, seq, sampler=sampler, max_new_tokens=size, **kwargs)
        for key in totals:
            totals[key] += getattr(out.stats, key)
        tokens = out.sequences[:, -size:]
        for row, ids in zip(active.tolist(), tokens.tolist()):
            new[row] += ids
        running = ~(tokens == eos_token_id).any(dim=1)
        seq, active = out.sequences[running], active[running]
    return new


def decode_completion(ids: list[int], tokenizer) -> str:
    """Generated ids up to (not including) the first EOS, decoded."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[:ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)
