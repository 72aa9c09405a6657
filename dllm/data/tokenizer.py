"""A small byte-level BPE tokenizer for the synthetic corpus (plus GSM8K train when mixed in).

Design:
- byte-level pre-tokenization and decoding, and no normalizer, so ``decode(encode(text)) == text``
  for any text, ours included;
- digits are split one per token before BPE, so numbers are spelled digit by digit and the same digit
  is the same token in the question, the ``<<a*b=c>>`` annotation and the ``#### N`` line;
- special tokens ``<|pad|>``, ``<|eos|>``, ``<|mask|>``, ``<|bos|>`` get ids 0, 1, 2, 3. Nothing is
  added automatically on encode: the trainer appends EOS and the samplers place masks.

Usage: ``python -m dllm.data.tokenizer --out runs/tokenizer.json`` trains on 20k generated problems
(``--gsm8k PATH`` mixes in GSM8K train) and prints token-length statistics.
"""

import argparse
import json
import shutil
import statistics
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dllm.data.gsm8k import load_gsm8k_train
from dllm.data.synthetic import PRESETS, ProblemConfig, format_example, generate

PAD, EOS, MASK, BOS = "<|pad|>", "<|eos|>", "<|mask|>", "<|bos|>"
SPECIAL_TOKENS = (PAD, EOS, MASK, BOS)  # in id order
DEFAULT_VOCAB_SIZE = 2048
# What a model folder holds beside tokenizer.json, so transformers' AutoTokenizer and chat front ends read it as
# dllm.load does: the special tokens by name, and the training format (format_example) as the chat template.
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "eos_token": EOS,
                    "mask_token": MASK, "bos_token": BOS, "clean_up_tokenization_spaces": False,
                    "model_max_length": 256}
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")  # "Question: ...\nAnswer:" as a chat template


def export_tokenizer(tokenizer: str | Path, folder: str | Path) -> None:
    """Write a model folder's tokenizer files from ``tokenizer`` (a tokenizer.json, or a folder holding one):
    tokenizer.json, and the folder's tokenizer_config.json and chat_template.jinja where it has them, else this
    project's (every model trained here reads the synthetic training format)."""
    source, folder = Path(tokenizer), Path(folder)
    source_folder = source if source.is_dir() else source.parent
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "tokenizer.json" if source.is_dir() else source, folder / "tokenizer.json")
    config = source_folder / "tokenizer_config.json"
    if config.is_file() and config.resolve() != (folder / config.name).resolve():
        shutil.copyfile(config, folder / config.name)
    elif not config.is_file():
        (folder / config.name).write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    template = source_folder / CHAT_TEMPLATE.name
    if (template if template.is_file() else CHAT_TEMPLATE).resolve() != (folder / CHAT_TEMPLATE.name).resolve():
        shutil.copyfile(template if template.is_file() else CHAT_TEMPLATE, folder / CHAT_TEMPLATE.name)


def _untrained_bpe() -> Tokenizer:
    """A BPE model with the digit-splitting, byte-level pipeline and no merges yet."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    out_path: str | Path = "tokenizer.json") -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer on ``texts``, save it to ``out_path`` and return ``load_tokenizer(out_path)``.

    ``vocab_size`` is an upper bound: on a small corpus BPE runs out of pairs to merge before reaching it.
    """
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, seen or not
        min_frequency=2,
        show_progress=False,
    )
    tokenizer = _untrained_bpe()
    tokenizer.train_from_iterator(texts, trainer=trainer)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_path))
    return load_tokenizer(out_path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a ``tokenizer.json`` written by ``train_tokenizer`` with pad, EOS, mask and BOS configured."""
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        pad_token=PAD,
        eos_token=EOS,
        mask_token=MASK,
        bos_token=BOS,
        # The default cleanup rewrites " ." to "." and would break exact round trips.
        clean_up_tokenization_spaces=False,
    )


def training_corpus(n_synthetic: int = 20_000, seed: int = 0, config: ProblemConfig = PRESETS["default"],
                    gsm8k_path: str | Path | None = None) -> list[str]:
    """Formatted examples to train a tokenizer on: synthetic training problems, plus GSM8K train if given.

    Built from the training stream only, so the held-out set does not shape the vocabulary.
    """
    records = generate(n_synthetic, seed, config)
    if gsm8k_path is not None:
        records += load_gsm8k_train(gsm8k_path)
    return [format_example(r["question"], r["answer"]) for r in records]


def length_stats(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> dict[str, float]:
    """Mean, median, 95th percentile and max token count of ``texts`` (no special tokens added)."""
    lengths = sorted(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    return {
        "mean": statistics.fmean(lengths),
        "median": statistics.median(lengths),
        "p95": lengths[int(0.95 * (len(lengths) - 1))],
        "max": lengths[-1],
    }


def main(argv: list[str] | None = None) -> None:
    """Train the default tokenizer and print how long a typical example is in tokens."""
    parser = argparse.ArgumentParser(description="Train the dllm BPE tokenizer on generated problems.")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--n-synthetic", type=int, default=20_000)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k", help="local GSM8K *train* JSONL to mix in")
    args = parser.parse_args(argv)
    corpus = training_corpus(args.n_synthetic, args.seed, PRESETS[args.preset], args.gsm8k)
    tokenizer = train_tokenizer(corpus, args.vocab_size, args.out)
    stats = length_stats(tokenizer, corpus)
    print(f"wrote {args.out}: vocab {len(tokenizer)}, trained on {len(corpus)} examples")
    print("tokens per formatted example: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
