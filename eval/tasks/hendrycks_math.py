r"""MATH (Hendrycks et al. 2021): competition problems with LaTeX answers.

`subset="500"` (default) is MATH-500, the 500-problem test subset of "Let's Verify Step by Step"
(Lightman et al. 2023), whose records carry an `answer` field; `subset="full"` is the 5000-problem
test set, whose records have no `answer`: the reference is the last `\boxed{}` of the solution.
Prompts are zero-shot and ask for a boxed answer. Problem ids are MATH-500's `unique_id`, else
`math/<idx>` (the local file's `idx`; from the hub, whose per-subject configs come in another order,
the position in the concatenation). Scoring (`dllm.eval.scoring.score_math`) takes the
`\boxed{}`/`\fbox{}` (or a "The final answer is ..." sentence; with several boxes, the answer
math-verify reads from the whole completion) and checks equivalence with math-verify.
"""

from __future__ import annotations

from dllm.eval.answers import math_reference
from dllm.eval.data import HubSource, load_records
from dllm.eval.scoring import score_math
from dllm.eval.tasks.base import Message, Task, user_message

__all__ = ["MATH"]

SUBJECT_CONFIGS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
SOURCES = {
    "500": ("math500_test.jsonl", HubSource("HuggingFaceH4/MATH-500", None, "test")),
    "full": ("math_test.jsonl", [HubSource("EleutherAI/hendrycks_math", c, "test") for c in SUBJECT_CONFIGS]),
}
FIELDS = ("problem", ("answer", "solution"))  # MATH-500 carries the answer; the full set's is in the solution
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _reference_answer(record: dict) -> str:
    """The gold answer: the record's `answer` (MATH-500) or its solution's last `\\boxed{}` (full)."""
    return record["answer"] if record.get("answer") else math_reference(record["solution"])


class MATH(Task):
    """MATH-500 or the full MATH test set."""

    name = "math"
    metric = "math_accuracy"
    plain_stop = ("Problem:",)
    subsets = tuple(SOURCES)

    def __init__(self, *, subset: str = "500", chat: bool = False, data_file: str | None = None) -> None:
        if subset not in SOURCES:
            raise ValueError(f"subset must be one of {sorted(SOURCES)}, got {subset!r}")
        super().__init__(chat=chat, data_file=data_file)
        self.subset = subset

    def _load(self) -> list[dict]:
        filename, hub = SOURCES[self.subset]
        records = load_records(filename, hub, self.data_file, FIELDS)
        return [
            {**r, "id": r.get("unique_id") or f"math/{r.get('idx', i)}", "reference": _reference_answer(r)}
            for i, r in enumerate(records)
        ]

    def _plain_prompt(self, problem: dict) -> str:
        return f"Problem:\n{problem['problem'].strip()}\n\n{INSTRUCTION}\n\nSolution:"

    def _chat_prompt(self, problem: dict) -> list[Message]:
        return user_message(f"{problem['problem'].strip()}\n\n{INSTRUCTION}")

    def _score(self, problem: dict, completion: str) -> dict:
        # Without an `answer` field the gold is the solution, read as a completion is: a solution that
        # boxes several answers ("$\boxed{-2}$ and $\boxed{1}$") has all of them, not its last box.
        gold = problem["reference"] if problem.get("answer") else problem.get("solution") or problem["reference"]
        return score_math(completion, gold)
