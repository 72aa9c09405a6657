"""Evaluation tasks behind one interface: `get_task(name, **kw)`.

Each task has `load(limit=None)`, `prompt(problem, chat=None)`, `score(problem, completion)`,
`score_many(problems, completions)`, `summarize(scores)`, `stop` and `metric` (its evaluate module).
"""

from __future__ import annotations

from dllm.eval.tasks.base import CodeTask, Task
from dllm.eval.tasks.gsm8k import GSM8K, format_qa_prompt
from dllm.eval.tasks.hendrycks_math import MATH
from dllm.eval.tasks.humaneval import HumanEval
from dllm.eval.tasks.mbpp import MBPP
from dllm.eval.tasks.synthetic import Synthetic

__all__ = [
    "GSM8K",
    "MATH",
    "MBPP",
    "TASKS",
    "CodeTask",
    "HumanEval",
    "Synthetic",
    "Task",
    "format_qa_prompt",
    "get_task",
]

TASKS: dict[str, type[Task]] = {
    "gsm8k": GSM8K,
    "math": MATH,
    "humaneval": HumanEval,
    "mbpp": MBPP,
    "synthetic": Synthetic,
}


def get_task(name: str, **kwargs) -> Task:
    """Build the task called `name` (one of TASKS) with its options, e.g. `get_task("math", subset="full")`."""
    try:
        task_class = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
    return task_class(**kwargs)
