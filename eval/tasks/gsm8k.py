"""GSM8K (Cobbe et al. 2021): grade-school word problems with a `#### N` final answer.

Plain prompts are few-shot chain of thought in the "Question: ...\\nAnswer: ..." format, with worked
solutions drawn from the train split: `num_fewshot` (default 5, lm-eval's `gsm8k` default) examples at
fixed indices chosen by `random.Random(fewshot_seed)`, so every run and every model sees the same
prompt. The train solutions' calculator annotations (`<<48/2=24>>`) are removed: they are an artefact
of the dataset's tooling, not text a model should imitate. Chat prompts are zero-shot.

Scoring (`dllm.eval.scoring.score_gsm8k`): `correct` reads the answer the completion states
(`#### N`, "The answer is N", `\\boxed{N}`), else its last number; `strict` only the `#### N` / "The
answer is N" format; numbers are normalised first. lm-eval's own `strict-match` / `flexible-extract`
numbers are reported beside them (`lm_eval_strict_match`, `lm_eval_flexible_extract`).
"""

from __future__ import annotations

import random
import re
from functools import cached_property

from dllm.data.synthetic import format_example
from dllm.eval.answers import gsm8k_reference
from dllm.eval.data import HubSource, load_records
from dllm.eval.scoring import score_gsm8k, summarize_gsm8k
from dllm.eval.tasks.base import Message, Task, user_message

__all__ = ["GSM8K", "format_qa_prompt", "qa_problems", "strip_calculator_annotations"]

HUB_TEST = HubSource("openai/gsm8k", "main", "test")
HUB_TRAIN = HubSource("openai/gsm8k", "main", "train")
FIELDS = ("question", "answer")
FEWSHOT_HELP = ("note that few-shot prompts need GSM8K's train split too: set DLLM_DATA_DIR to a folder holding "
                "gsm8k_train.jsonl (and gsm8k_test.jsonl), or pass --num-fewshot 0 (Python: num_fewshot=0, or "
                "fewshot_file=)")
CHAT_INSTRUCTION = (
    "Solve the following math problem step by step. "
    'End your response with a final line of the form "The answer is N", where N is the final number.'
)


def format_qa_prompt(question: str) -> str:
    """The prompt for one question: `"Question: {question}\nAnswer:"`.

    It is `dllm.data.format_example` without an answer, the function that formats the training text
    (`format_example(question, answer)` = prompt + " " + answer), so a model trained on that text
    sees exactly this prefix at test time.
    """
    return format_example(question)


def strip_calculator_annotations(solution: str) -> str:
    """Remove GSM8K's `<<expression=result>>` calculator annotations from a worked solution."""
    return re.sub(r"<<[^>]*>>", "", solution)


def qa_problems(records: list[dict], prefix: str) -> list[dict]:
    """Problem dicts from question/answer records (id: the record's `id` if any, else prefix/index)."""
    return [
        {
            **record,
            "id": str(record.get("id", f"{prefix}/{index}")),
            "reference": gsm8k_reference(record["answer"]),
        }
        for index, record in enumerate(records)
    ]


class GSM8K(Task):
    """GSM8K test split (1319 problems)."""

    name = "gsm8k"
    metric = "gsm8k_accuracy"
    plain_stop = ("Question:",)  # the model starting the next few-shot question

    def __init__(
        self,
        *,
        num_fewshot: int = 5,
        fewshot_seed: int = 1234,
        chat: bool = False,
        data_file: str | None = None,
        fewshot_file: str | None = None,
    ) -> None:
        if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
            raise ValueError(f"num_fewshot must be an int >= 0, got {num_fewshot!r}")
        super().__init__(chat=chat, data_file=data_file)
        self.num_fewshot = num_fewshot
        self.fewshot_seed = fewshot_seed
        self.fewshot_file = fewshot_file

    def _load(self) -> list[dict]:
        local_help = None
        if self.num_fewshot and not self.chat:
            local_help = ("pass the file as --data-file FILE (Python: data_file=), or set DLLM_DATA_DIR to a folder "
                          f"holding gsm8k_test.jsonl; {FEWSHOT_HELP}")
        records = load_records("gsm8k_test.jsonl", HUB_TEST, self.data_file, FIELDS, local_help)
        return qa_problems(records, self.name)

    @cached_property
    def fewshot_examples(self) -> list[dict]:
        """The few-shot train examples (fixed by `fewshot_seed`)."""
        if self.num_fewshot == 0:
            return []
        train = load_records("gsm8k_train.jsonl", HUB_TRAIN, self.fewshot_file, FIELDS, FEWSHOT_HELP)
        if self.num_fewshot > len(train):
            raise ValueError(f"num_fewshot={self.num_fewshot} is more than the {len(train)} train examples")
        indices = random.Random(self.fewshot_seed).sample(range(len(train)), self.num_fewshot)
        return [train[i] for i in indices]

    def _plain_prompt(self, problem: dict) -> str:
        shots = [
            format_example(shot["question"], strip_calculator_annotations(shot["answer"]).strip()) + "\n\n"
            for shot in self.fewshot_examples
        ]
        return "".join(shots) + format_qa_prompt(problem["question"])

    def _chat_prompt(self, problem: dict) -> list[Message]:
        return user_message(f"{CHAT_INSTRUCTION}\n\n{problem['question'].strip()}")

    def _score(self, problem: dict, completion: str) -> dict:
        return score_gsm8k(completion, problem["answer"])

    def summarize(self, scores) -> dict[str, float]:
        """Accuracy, strict-format accuracy and lm-eval's two gsm8k metrics (`summarize_gsm8k`)."""
        return summarize_gsm8k(scores)
