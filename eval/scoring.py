"""Scorers shared by the tasks and the `evaluate` metric modules: one definition of each metric.

- GSM8K-style numeric match against the `####` gold: `correct` compares the answer the completion
  states (`#### N`, "The answer is N", `\\boxed{N}`), else its last number; `strict` only the
  `#### N` / "The answer is N" format; `lm_eval_strict` / `lm_eval_flexible` reproduce lm-eval's gsm8k
  filters and exact match, labelled apart, so numbers compare with published lm-eval ones.
- MATH: symbolic equivalence with math-verify (Kydlicek et al., Hugging Face) of the extracted answer
  (several boxes: of the answer math-verify reads from the whole completion).
- Code: the unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", section 2.1), in its numerically stable product form.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

from dllm.eval.answers import (
    count_boxes,
    extract_last_number,
    extract_math_answer,
    extract_stated_number,
    extract_strict_number,
    gsm8k_reference,
    lm_eval_gsm8k_match,
    without_box_full_stops,
)

__all__ = [
    "accuracy",
    "estimate_pass_at_k",
    "math_equal",
    "pass_at_k",
    "pass_at_k_by_problem",
    "score_gsm8k",
    "score_math",
    "summarize_gsm8k",
]

logger = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own SIGALRM timeout, per parse and per comparison (integer s)


def score_gsm8k(completion: str, reference: str) -> dict:
    """Score a GSM8K-format completion against a gold solution (`... #### N`) or a bare gold number.

    Returns `correct` (the answer the completion states, by `#### N`, "The answer is N" or `\\boxed{N}`,
    else its last number), `strict` (only `#### N` or "The answer is N"), both extracted answers, the
    normalised reference, and `lm_eval_strict` / `lm_eval_flexible`: lm-eval's gsm8k `strict-match`
    and `flexible-extract` exact match, for comparison with published lm-eval numbers (its flexible
    filter takes the last number even after a stated answer).
    """
    gold = gsm8k_reference(reference)
    stated = extract_stated_number(completion)
    answer = stated if stated is not None else extract_last_number(completion)
    strict = extract_strict_number(completion)
    return {
        "correct": gold is not None and answer == gold,
        "strict": gold is not None and strict == gold,
        "answer": answer,
        "strict_answer": strict,
        "reference": gold,
        "lm_eval_strict": lm_eval_gsm8k_match(completion, reference, "strict-match"),
        "lm_eval_flexible": lm_eval_gsm8k_match(completion, reference, "flexible-extract"),
    }


def summarize_gsm8k(scores: Sequence[dict]) -> dict[str, float]:
    """`accuracy` (stated answer, else last number), `strict_accuracy`, and lm-eval's two gsm8k metrics.

    The lm-eval numbers are left out when some score lacks them (rows written before they existed).
    """
    summary = {
        "accuracy": accuracy(s["correct"] for s in scores),
        "strict_accuracy": accuracy(s["strict"] for s in scores),
    }
    for key, name in (("lm_eval_strict", "lm_eval_strict_match"), ("lm_eval_flexible", "lm_eval_flexible_extract")):
        if scores and all(key in s for s in scores):
            summary[name] = accuracy(s[key] for s in scores)
    return summary


def _math_verify_timeout() -> int | None:
    """math-verify's timeout uses SIGALRM, which works only on the main thread; elsewhere run without."""
    if threading.current_thread() is threading.main_thread():
        return MATH_VERIFY_TIMEOUT_S
    _warn_no_timeout()
    return None


@functools.cache
def _warn_no_timeout() -> None:
    logger.warning("math-verify called off the main thread: its SIGALRM timeout is disabled")


def _math_parse(text: str) -> list:
    """math-verify's parse of `text`: boxed answers first, then LaTeX and plain expressions."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(text, config, parsing_timeout=_math_verify_timeout())


def _math_verified(gold: list, predicted: list) -> bool:
    """math-verify's verdict, gold first (it is not symmetric); an empty parse is never equal."""
    from math_verify import verify

    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=_math_verify_timeout()))


def math_equal(prediction: str | None, reference: str) -> bool:
    r"""Whether two LaTeX answers are mathematically equivalent (`\frac{1}{2}` = `0.5` = `1/2`).

    Both sides are wrapped in `\boxed{}` and parsed by math-verify with LaTeX extraction (boxed first)
    plus plain-expression extraction; `verify` is called gold first, as math-verify requires (it is not
    symmetric). A parse or comparison that exceeds the timeout counts as not equal.
    """
    if not prediction:
        return False
    return _math_verified(_math_parse(f"\\boxed{{{reference}}}"), _math_parse(f"\\boxed{{{prediction}}}"))


def score_math(completion: str, reference: str) -> dict:
    r"""Score a MATH completion against a gold answer (or a full solution, whose last `\boxed{}` is used).

    One box (or none: a "The final answer is ..." sentence) is the answer. With several boxes,
    math-verify reads the whole completion and decides which form the answer, as it and lm-eval's
    MATH scorers do: boxes in one sentence are one answer (`$\boxed{1}$ and $\boxed{-2}$` is
    {1, -2}), a later sentence's box replaces earlier ones. A full stop inside a box is dropped. A
    full solution given as the reference is read by the same rule (as lm-eval's minerva_math reads
    its gold with math-verify), so a solution that boxes several answers has all of them as gold.
    """
    gold, gold_parsed = _math_read(reference)
    if gold is None:  # a reference without a box is the answer itself
        gold, gold_parsed = reference.strip(), _math_parse(f"\\boxed{{{reference.strip()}}}")
    answer, predicted = _math_read(completion)
    correct = _math_verified(gold_parsed, predicted) if answer else False
    return {"correct": correct, "answer": answer, "reference": gold}


def _math_read(text: str) -> tuple[str | None, list]:
    """The answer of a completion or solution and its math-verify parse (see `score_math`)."""
    text = without_box_full_stops(text)
    if count_boxes(text) > 1:
        parsed = _math_parse(text)
        return (parsed[-1] if parsed else extract_math_answer(text)), parsed
    answer = extract_math_answer(text)
    return answer, (_math_parse(f"\\boxed{{{answer}}}") if answer else [])


def accuracy(flags: Iterable[bool]) -> float:
    """Fraction of true flags (0.0 for none)."""
    values = [bool(flag) for flag in flags]
    return sum(values) / len(values) if values else 0.0


def estimate_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one problem: 1 - C(n-c, k) / C(n, k), as a stable product (Chen et al. 2021)."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i); no huge binomials, no overflow.
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def pass_at_k(samples_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """Mean unbiased pass@k over problems, each given as its list of per-sample pass flags."""
    if not samples_per_problem:
        return 0.0
    estimates = [estimate_pass_at_k(len(s), sum(map(bool, s)), k) for s in samples_per_problem]
    return sum(estimates) / len(estimates)


def pass_at_k_by_problem(
    problem_ids: Sequence[str], passed: Sequence[bool], ks: Sequence[int] = (1,)
) -> dict[str, float]:
    """pass@k for each k feasible with the fewest samples any problem has, grouping flags by problem id."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for problem_id, flag in zip(problem_ids, passed, strict=True):
        groups[problem_id].append(bool(flag))
    samples = list(groups.values())
    fewest = min((len(s) for s in samples), default=0)
    return {f"pass@{k}": pass_at_k(samples, k) for k in ks if k <= fewest}
