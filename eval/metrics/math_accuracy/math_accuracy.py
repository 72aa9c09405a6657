"""MATH accuracy: the last boxed answer of each completion checked against the gold with math-verify."""

from dllm.eval.metrics.shipped import ShippedMetric, article
from dllm.eval.scoring import accuracy, score_math


class MathAccuracy(ShippedMetric):
    """MATH accuracy through math-verify."""

    DESCRIPTION = r"""
    Accuracy of MATH-style completions. The answer is the last `\boxed{}` / `\fbox{}` of the completion
    (or a "The final answer is ..." sentence) and counts as correct when math-verify finds it equivalent
    to the gold answer (`\frac{1}{2}`, `0.5` and `1/2` agree). Same scoring as dllm's math task
    (`dllm.eval.scoring.score_math`).
    """
    INPUTS = r"""
    Args:
        predictions: list of model completions (str).
        references: list of gold answers in LaTeX, or full solutions (their last `\boxed{}` is used).
    Returns:
        accuracy: fraction of completions whose answer is equivalent to the gold, in [0, 1].
    Examples:
        >>> metric = evaluate.load(path)
        >>> metric.compute(predictions=["... so the answer is $\\boxed{0.5}$."], references=["\\frac{1}{2}"])
        {'accuracy': 1.0}
    """
    CITATION = article("hendrycks2021math", "Measuring Mathematical Problem Solving With the MATH Dataset",
                       "Hendrycks, Dan and others", "NeurIPS", 2021)

    def _compute(self, predictions, references):
        return {"accuracy": accuracy(score_math(p, r)["correct"] for p, r in zip(predictions, references))}
