"""The task interface: load problems, build prompts, score completions, summarise scores."""

from __future__ import annotations

from collections.abc import Sequence

from dllm.eval.answers import truncate_at_stop
from dllm.eval.sandbox import SandboxResult, run_many
from dllm.eval.scoring import accuracy, pass_at_k_by_problem

__all__ = ["CodeTask", "Message", "Task", "user_message"]

Message = dict[str, str]  # {"role": ..., "content": ...}, the chat-template input format


def user_message(content: str) -> list[Message]:
    """A one-turn chat prompt."""
    return [{"role": "user", "content": content}]


class Task:
    """One benchmark. Subclasses set `name`, `metric` and the stops, and implement the hooks.

    `chat=True` makes `prompt` return chat messages (zero-shot, for instruct models) instead of a
    plain completion prompt; `stop` follows the same mode. `load(limit)` returns problem dicts with at
    least `id`; `score(problem, completion)` returns at least `correct` and the extracted `answer`.
    """

    name: str = ""
    metric: str = ""  # the evaluate module shipped in dllm/eval/metrics (see dllm.eval.metrics)
    plain_stop: tuple[str, ...] = ()
    chat_stop: tuple[str, ...] = ()
    subsets: tuple[str, ...] = ()  # the values the `subset` option takes (none: the task has no subsets)

    def __init__(self, *, chat: bool = False, data_file: str | None = None) -> None:
        self.chat = chat
        self.data_file = data_file

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop sequences for generations from this task's prompts."""
        return self.chat_stop if self.chat else self.plain_stop

    def load(self, limit: int | None = None) -> list[dict]:
        """The problems, in the benchmark's order; the first `limit` when given."""
        problems = self._load()
        return problems if limit is None else problems[:limit]

    def prompt(self, problem: dict, chat: bool | None = None) -> str | list[Message]:
        """The model input for `problem`: a string, or chat messages when `chat` (default: the task's)."""
        use_chat = self.chat if chat is None else chat
        return self._chat_prompt(problem) if use_chat else self._plain_prompt(problem)

    def score(self, problem: dict, completion: str) -> dict:
        """Score one completion (cut at the stop sequences first, as a generation loop would)."""
        return {"id": problem["id"], **self._score(problem, truncate_at_stop(completion, self.stop))}

    def score_many(self, problems: Sequence[dict], completions: Sequence[str]) -> list[dict]:
        """Score completions paired with their problems (several completions may share a problem)."""
        return [self.score(p, c) for p, c in zip(problems, completions, strict=True)]

    def summarize(self, scores: Sequence[dict]) -> dict[str, float]:
        """Aggregate per-completion scores into the task's headline numbers."""
        return {"accuracy": accuracy(s["correct"] for s in scores)}

    def _load(self) -> list[dict]:
        raise NotImplementedError

    def _plain_prompt(self, problem: dict) -> str:
        raise NotImplementedError

    def _chat_prompt(self, problem: dict) -> list[Message]:
        raise NotImplementedError

    def _score(self, problem: dict, completion: str) -> dict:
        raise NotImplementedError


class CodeTask(Task):
    """A task scored by running the completion against the problem's tests in the sandbox.

    The solution (`program`) runs in the sandbox's program process and the problem's tests (`tests`) in
    its launcher, calling into it; a completion passes only when the tests ran to their end, so one that
    exits, kills its interpreter, or digs into the harness before the tests fails.
    """

    metric = "code_pass_at_k"

    def __init__(
        self,
        *,
        chat: bool = False,
        data_file: str | None = None,
        timeout: float = 10.0,
        max_workers: int | None = None,
    ) -> None:
        super().__init__(chat=chat, data_file=data_file)
        self.timeout = timeout
        self.max_workers = max_workers

    def solution(self, problem: dict, completion: str) -> str:
        """The code a completion proposes (fenced block for chat answers, else the cut completion)."""
        raise NotImplementedError

    def program(self, problem: dict, solution: str) -> str:
        """The code that runs as the (untrusted) program: the solution with what it needs around it."""
        raise NotImplementedError

    def tests(self, problem: dict) -> str:
        """The problem's tests, run apart from the program and calling into it (trusted code)."""
        raise NotImplementedError

    def score(self, problem: dict, completion: str) -> dict:
        """Run one completion's test program in the sandbox."""
        return self.score_many([problem], [completion])[0]

    def score_many(self, problems: Sequence[dict], completions: Sequence[str]) -> list[dict]:
        """Run the test programs in parallel sandboxes (up to `max_workers`, default the core count)."""
        solutions = [self.solution(p, c) for p, c in zip(problems, completions, strict=True)]
        programs = [self.program(p, code) for p, code in zip(problems, solutions, strict=True)]
        results = run_many(programs, tests=[self.tests(p) for p in problems], max_workers=self.max_workers,
                           timeout=self.timeout)
        return [_code_score(p, code, r) for p, code, r in zip(problems, solutions, results, strict=True)]

    def summarize(self, scores: Sequence[dict], ks: Sequence[int] = (1, 10, 100)) -> dict[str, float]:
        """Unbiased pass@k (each k no larger than the fewest samples of any problem)."""
        return pass_at_k_by_problem([s["id"] for s in scores], [s["passed"] for s in scores], ks)


def _code_score(problem: dict, solution: str, result: SandboxResult) -> dict:
    """The score dict of one sandbox run."""
    return {
        "id": problem["id"],
        "correct": result.passed,
        "answer": solution,
        "passed": result.passed,
        "status": result.status,
        "stderr": result.stderr[-1000:],
        "duration": result.duration,
    }
