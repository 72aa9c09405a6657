"""The tasks' metrics as `evaluate` modules shipped inside the package, loadable offline.

Each module is a folder here holding `<name>/<name>.py` (an `evaluate.Metric` subclass) whose scoring
is a call into `dllm.eval.scoring`, the same functions the tasks use. Load one with
`evaluate.load(metric_path("gsm8k_accuracy"))` or `load_metric("gsm8k_accuracy")`; no network needed.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["METRICS", "load_metric", "metric_path"]

METRICS = ("code_pass_at_k", "gsm8k_accuracy", "math_accuracy")


def metric_path(name: str) -> str:
    """Local path of the metric script `name` (pass it to `evaluate.load`)."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; choose one of {list(METRICS)}")
    return str(Path(__file__).resolve().parent / name / f"{name}.py")


def load_metric(name: str, **kwargs):
    """`evaluate.load` on the shipped module `name` (kwargs go to `evaluate.load`)."""
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)
