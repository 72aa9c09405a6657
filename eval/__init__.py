"""Evaluation: benchmark tasks, answer extraction and scorers, the code sandbox, offline metrics.

`get_task(name, **kw)` builds a task (gsm8k, math, humaneval, mbpp, synthetic); `dllm.eval.sandbox`
runs model-written code confined in a subprocess; `dllm.eval.metrics` ships the metrics as `evaluate`
modules. The runner that calls models lives elsewhere.
"""

if not __name__.startswith("dllm."):  # imported by its bare name from the repository root: not ours to answer
    from dllm._root_folders import hand_over

    hand_over(__name__, __file__)
else:
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

# The runner (`dllm eval TASK`) and its results reader (`dllm eval report`), imported on first use:
# importing them here would make `python -m dllm.eval.runner` (torchrun's entry) load the module twice.
# The lm-eval plugin (dllm.eval.lm_eval_plugin) is never imported here: lm-eval is optional.
_LAZY = {"EvalConfig": ("runner", "EvalConfig"), "EvalError": ("runner", "EvalError"), "run_eval": ("runner", "run"),
         "load_samples": ("report", "load_samples"), "summarize_folder": ("report", "summarize_folder")}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
