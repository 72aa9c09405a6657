"""Evaluation: benchmark tasks, answer extraction and scorers, the code sandbox, offline metrics.

`get_task(name, **kw)` builds a task (gsm8k, math, humaneval, mbpp, synthetic); `dllm.eval.sandbox`
runs model-written code confined in a subprocess; `dllm.eval.metrics` ships the metrics as `evaluate`
modules. The runner that calls models lives elsewhere.
"""

from dllm.eval.answers import (
    extract_boxed,
    extract_code_block,
    extract_last_number,
    extract_math_answer,
    extract_strict_number,
    normalize_number,
    truncate_at_stop,
)
from dllm.eval.metrics import load_metric, metric_path
from dllm.eval.sandbox import Isolation, Limits, SandboxResult, run_many, run_program
from dllm.eval.scoring import (
    accuracy,
    estimate_pass_at_k,
    math_equal,
    pass_at_k,
    pass_at_k_by_problem,
    score_gsm8k,
    score_math,
)
from dllm.eval.tasks import TASKS, Task, format_qa_prompt, get_task

__all__ = [
    "TASKS",
    "Isolation",
    "Limits",
    "SandboxResult",
    "Task",
    "accuracy",
    "estimate_pass_at_k",
    "extract_boxed",
    "extract_code_block",
    "extract_last_number",
    "extract_math_answer",
    "extract_strict_number",
    "format_qa_prompt",
    "get_task",
    "load_metric",
    "math_equal",
    "metric_path",
    "normalize_number",
    "pass_at_k",
    "pass_at_k_by_problem",
    "run_many",
    "run_program",
    "score_gsm8k",
    "score_math",
    "truncate_at_stop",
]
