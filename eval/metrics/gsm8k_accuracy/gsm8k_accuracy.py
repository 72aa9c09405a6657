"""GSM8K accuracy: flexible (last number) and strict (`#### N`) match of completions to gold answers."""

from dllm.eval.metrics.shipped import ShippedMetric, article
from dllm.eval.scoring import score_gsm8k, summarize_gsm8k


class Gsm8kAccuracy(ShippedMetric):
    """Flexible and strict GSM8K accuracy."""

    DESCRIPTION = """
    Accuracy of GSM8K-style completions. `accuracy` counts a completion correct when the answer it
    states (`#### N`, "The answer is N", `\\boxed{N}`), else its last number, equals the gold number;
    `strict_accuracy` when the number after `####` (or "The answer is") does. Numbers are normalised
    first (thousands separators, `$`, trailing zeros). `lm_eval_strict_match` / `lm_eval_flexible_extract`
    are lm-eval's gsm8k metrics. Same scoring as dllm's gsm8k and synthetic tasks
    (`dllm.eval.scoring.score_gsm8k`).
    """
    INPUTS = """
    Args:
        predictions: list of model completions (str).
        references: list of gold solutions ending in `#### N`, or bare gold numbers (str).
    Returns:
        accuracy: flexible-match accuracy in [0, 1].
        strict_accuracy: strict-format accuracy in [0, 1].
        lm_eval_strict_match, lm_eval_flexible_extract: lm-eval's gsm8k exact match under each filter.
    Examples:
        >>> metric = evaluate.load(path)
        >>> metric.compute(predictions=["So she pays $1,200.00.\\n#### 1200"], references=["... #### 1200"])
        {'accuracy': 1.0, 'strict_accuracy': 1.0, 'lm_eval_strict_match': 1.0, 'lm_eval_flexible_extract': 1.0}
    """
    CITATION = article("cobbe2021gsm8k", "Training Verifiers to Solve Math Word Problems",
                       "Cobbe, Karl and others", "arXiv preprint arXiv:2110.14168", 2021)

    def _compute(self, predictions, references):
        scores = [score_gsm8k(p, r) for p, r in zip(predictions, references)]
        return summarize_gsm8k(scores)
