"""Prompt-response pairs for fine-tuning a real checkpoint (the FeF recipe's ~72k pairs), read with ``datasets``.

A JSONL/JSON/Parquet file or a Hugging Face hub dataset with a prompt and a response column (names
configurable), or a chat ``messages`` column (the last assistant turn is the response, the turns before it
the prompt). Each pair becomes an ``Example`` laid out as the block-diffusion recipe lays an answer: the
prompt (through the tokenizer's chat template when it has one and ``chat_template`` is on, as chat models
are prompted at inference), then the response, one EOS, EOS padding to whole blocks and one EOS block.
Pairs longer than ``max_tokens`` are dropped at load (counted in ``PairData.dropped``), never truncated
(a cut response would teach the model to stop mid-answer).

Order is a pure function of (seed, step), as for the synthetic stream (``dllm.training.batches``): epoch e
is a permutation seeded by (seed, e), step s takes global items s*B..(s+1)*B-1 of the concatenated
epochs and process r of W takes items r::W. A resumed run replays exactly with no iterator state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dllm.training.batches import Example, derive_seed, region_length

FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class PairData:
    """Tokenized pairs, in file order, and how many were dropped for length."""

    examples: list[Example]
    dropped: int

    def split(self, heldout: int) -> tuple[PairData, list[Example]]:
        """(the pairs less the last ``heldout``, those last ones): a held-out set never trained on."""
        if heldout <= 0:
            return self, []
        return PairData(self.examples[:-heldout], self.dropped), self.examples[-heldout:]

    def step_examples(self, seed: int, step: int, batch_size: int, rank: int = 0, world: int = 1) -> list[Example]:
        """This process's share of step ``step``'s batch (epochs reshuffled by seed; see the module docstring)."""
        n = len(self.examples)
        items = range(step * batch_size, (step + 1) * batch_size)
        perms: dict[int, list[int]] = {}
        chosen = []
        for i in items:
            epoch = i // n
            if epoch not in perms:
                generator = torch.Generator().manual_seed(derive_seed(seed, "pairs", epoch) % 2**63)
                perms[epoch] = torch.randperm(n, generator=generator).tolist()
            chosen.append(self.examples[perms[epoch][i % n]])
        return chosen[rank::world]


def load_pairs(source: str, tokenizer, *, block_size: int, max_tokens: int, prompt_field: str = "prompt",
               response_field: str = "response", chat_template: bool = True, split: str = "train") -> PairData:
    """Read ``source`` (a local data file, or a hub dataset name) and tokenize every pair -> PairData."""
    import datasets

    path = Path(source)
    if path.suffix in FILE_TYPES and not path.is_file():
        raise ValueError(f"prefix.pairs={source!r}: no such file")
    if path.is_file():
        if path.suffix not in FILE_TYPES:
            raise ValueError(f"prefix.pairs={source!r}: a data file must end in one of {sorted(FILE_TYPES)}")
        table = datasets.load_dataset(FILE_TYPES[path.suffix], data_files=str(path), split=split)
    else:
        table = datasets.load_dataset(source, split=split)
    columns = set(table.column_names)
    chat = "messages" in columns and not {prompt_field, response_field} <= columns
    if not chat and not {prompt_field, response_field} <= columns:
        raise ValueError(f"prefix.pairs={source!r} has columns {sorted(columns)}: it needs "
                         f"{prompt_field!r} and {response_field!r} (prefix.prompt_field / prefix.response_field) "
                         "or a chat 'messages' column")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: the answer region ends with EOS")
    templated = chat_template and getattr(tokenizer, "chat_template", None)
    examples, dropped = [], 0
    for index, record in enumerate(table):
        if chat:
            messages = list(record["messages"])
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"prefix.pairs={source!r}, record {index}: the last message must be the "
                                 "assistant's (the response)")
            turns, response = messages[:-1], messages[-1]["content"]
        else:
            turns, response = [{"role": "user", "content": record[prompt_field]}], record[response_field]
        if not isinstance(response, str) or not all(isinstance(t.get("content"), str) for t in turns):
            raise ValueError(f"prefix.pairs={source!r}, record {index}: prompt and response must be strings")
        if templated:
            prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt, list):  # transformers >= 5 may return a BatchEncoding
                prompt = list(prompt["input_ids"])
        else:
            prompt = tokenizer("\n\n".join(t["content"] for t in turns), add_special_tokens=False)["input_ids"]
        answer = tokenizer(response, add_special_tokens=False)["input_ids"]
        size = region_length("block_causal", len(answer) + 1, block_size, 0)
        if len(prompt) + size > max_tokens:
            dropped += 1
            continue
        examples.append(Example(tuple(prompt), tuple(answer) + (eos,) * (size - len(answer)), len(answer) + 1))
    if not examples:
        raise ValueError(f"prefix.pairs={source!r}: no pair fits prefix.max_tokens={max_tokens} "
                         f"({dropped} dropped)")
    return PairData(examples, dropped)
