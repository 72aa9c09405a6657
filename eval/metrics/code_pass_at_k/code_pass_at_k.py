"""pass@k of code candidates, each run against its problem's test program in dllm's sandbox."""

import datasets

from dllm.eval.metrics.shipped import ShippedMetric, article
from dllm.eval.sandbox import run_many
from dllm.eval.scoring import pass_at_k


class CodePassAtK(ShippedMetric):
    """Sandboxed pass@k."""

    FEATURES = {"predictions": datasets.Sequence(datasets.Value("string")), "references": datasets.Value("string")}
    DESCRIPTION = """
    Unbiased pass@k (Chen et al. 2021) of code candidates. Each candidate runs in dllm's sandbox (a separate
    confined process; see `dllm.eval.sandbox`), never in the evaluating process, and its problem's test
    program runs beside it, calling into it; it passes when the tests run to their end. Unlike the hub's `code_eval` it
    loads offline and needs no opt-in environment variable, because the code never runs in-process.
    """
    INPUTS = """
    Args:
        predictions: list of candidate lists, one list of program strings per problem.
        references: list of test programs (str), one per problem, run against each candidate.
        k: list of k values (default [1]); each must not exceed the number of candidates per problem.
        timeout: wall-clock seconds per program (default 10).
        max_workers: parallel sandboxes (default: the number of cores).
    Returns:
        pass@k for each k, in [0, 1].
    Examples:
        >>> metric = evaluate.load(path)
        >>> metric.compute(predictions=[["def f():\\n    return 1"]], references=["assert f() == 1"], k=[1])
        {'pass@1': 1.0}
    """
    CITATION = article("chen2021codex", "Evaluating Large Language Models Trained on Code",
                       "Chen, Mark and others", "arXiv preprint arXiv:2107.03374", 2021)

    def _compute(self, predictions, references, k=(1,), timeout=10.0, max_workers=None):
        programs = [c for cands in predictions for c in cands]
        tests = [test for cands, test in zip(predictions, references) for _ in cands]
        results = iter(run_many(programs, tests=tests, timeout=timeout, max_workers=max_workers))
        flags = [[next(results).passed for _ in cands] for cands in predictions]
        return {f"pass@{kk}": pass_at_k(flags, kk) for kk in k}
