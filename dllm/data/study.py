"""Difficulty study of a problem config: lengths in tokens, steps per problem, answer range.

``python -m dllm.data.study [--preset default] [--tokenizer PATH]`` prints the report; without a
tokenizer one is trained on the fly from the training stream (a few seconds).
"""

import argparse
import statistics
import tempfile
from collections import Counter
from fractions import Fraction
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from dllm.data.calc import annotations, final_answer
from dllm.data.synthetic import PRESETS, ProblemConfig, format_example, generate
from dllm.data.tokenizer import length_stats, load_tokenizer, train_tokenizer, training_corpus


def difficulty_report(tokenizer: PreTrainedTokenizerFast, config: ProblemConfig = PRESETS["default"],
                      n: int = 2000, seed: int = 1) -> dict[str, object]:
    """Token lengths (question, answer, formatted example), step counts and the final-answer range.

    Steps are counted as the answer's ``<<...>>`` annotations, one per operation.
    """
    problems = generate(n, seed, config)
    finals = [Fraction(final_answer(p["answer"])) for p in problems]
    examples = [format_example(p["question"], p["answer"]) for p in problems]
    return {
        "n": n,
        "question_tokens": length_stats(tokenizer, [p["question"] for p in problems]),
        "answer_tokens": length_stats(tokenizer, [p["answer"] for p in problems]),
        "example_tokens": length_stats(tokenizer, examples),
        "steps": dict(sorted(Counter(len(annotations(p["answer"])) for p in problems).items())),
        "answer_min": float(min(finals)),
        "answer_max": float(max(finals)),
        "answer_median": float(statistics.median(finals)),
        "distinct_questions": len({p["question"] for p in problems}),
    }


def format_report(report: dict[str, object]) -> str:
    """One line per entry, numbers rounded for reading."""
    def show(value: object) -> str:
        if isinstance(value, dict):
            return ", ".join(f"{k} {show(v)}" for k, v in value.items())
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    return "\n".join(f"{key}: {show(value)}" for key, value in report.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Report the difficulty of a synthetic-problem preset.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--tokenizer", help="tokenizer.json to measure with (default: train one now)")
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = train_tokenizer(training_corpus(), out_path=Path(tmp) / "tokenizer.json")
    print(format_report(difficulty_report(tokenizer, PRESETS[args.preset], args.n)))


if __name__ == "__main__":
    main()
