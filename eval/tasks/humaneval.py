"""HumanEval (Chen et al. 2021): complete a Python function from its signature and docstring.

Plain prompts are the problem's prompt; the completion is cut at the Codex paper's stop sequences
(a new top-level def/class/if-main/print/comment). Chat prompts ask for the whole function in a fenced
block; when a completion holds a fenced block, that block is the solution. The program is the
prompt (keeping its imports and helper functions) and the solution; the problem's `test` and
`check(entry_point)` run apart in the sandbox's launcher, calling into it (`dllm.eval.sandbox`).
"""

from __future__ import annotations

from dllm.eval.answers import extract_code_block, truncate_at_stop
from dllm.eval.data import HubSource, load_records
from dllm.eval.tasks.base import CodeTask, Message, user_message

__all__ = ["HumanEval"]

HUB = HubSource("openai/openai_humaneval", None, "test")
FIELDS = ("task_id", "prompt", "test", "entry_point")
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


class HumanEval(CodeTask):
    """The 164 HumanEval problems."""

    name = "humaneval"
    plain_stop = STOP

    def _load(self) -> list[dict]:
        return [{**r, "id": r["task_id"]} for r in load_records("humaneval.jsonl", HUB, self.data_file, FIELDS)]

    def _plain_prompt(self, problem: dict) -> str:
        return problem["prompt"]

    def _chat_prompt(self, problem: dict) -> list[Message]:
        return user_message(
            "Complete the following Python function. Reply with the complete function "
            f"(signature included) in one ```python code block.\n\n```python\n{problem['prompt']}```"
        )

    def solution(self, problem: dict, completion: str) -> str:
        """The fenced block when there is one (a chat answer), else the completion cut at the stops."""
        block = extract_code_block(completion, must_contain=f"def {problem['entry_point']}(")
        return block if block is not None else truncate_at_stop(completion, STOP)

    def program(self, problem: dict, solution: str) -> str:
        """Prompt + solution; a solution that redefines the function simply follows the stub."""
        defines_entry = f"def {problem['entry_point']}(" in solution
        # The prompt ends in a docstring-only function, valid on its own, so a full redefinition may
        # follow it; keeping the prompt keeps its imports and helper functions.
        return f"{problem['prompt']}\n{solution}\n" if defines_entry else f"{problem['prompt']}{solution}\n"

    def tests(self, problem: dict) -> str:
        """The problem's `check` and its call on the entry point."""
        return f"{problem['test']}\n\ncheck({problem['entry_point']})\n"
