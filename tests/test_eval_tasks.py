"""Tasks: data resolution, prompts, and the scorers on reference answers (GSM8K, MATH, synthetic).

The benchmark files come from the project's shared/data folder through DLLM_DATA_DIR; nothing here
touches the network (the hub loader is replaced by one that fails).
"""

import json
import time
from pathlib import Path

import pytest

from dllm.data.synthetic import format_example
from dllm.eval import data as data_module
from dllm.eval import format_qa_prompt, get_task
from dllm.eval.tasks.gsm8k import strip_calculator_annotations

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _no_network(sources):
    raise AssertionError(f"tests must not reach the hub: {sources}")


@pytest.fixture(autouse=True)
def data_dir(monkeypatch):
    """Point DLLM_DATA_DIR at shared/data and make any hub access an error."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"benchmark data folder not found at {DATA_DIR}")
    monkeypatch.setenv("DLLM_DATA_DIR", str(DATA_DIR))
    monkeypatch.setattr(data_module, "_load_hub", _no_network)


def test_get_task_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        get_task("gsm9k")
    with pytest.raises(ValueError, match="subset"):
        get_task("math", subset="train")


@pytest.mark.parametrize(
    ("name", "kwargs", "count", "first_id"),
    [
        ("gsm8k", {}, 1319, "gsm8k/0"),
        ("math", {}, 500, "test/precalculus/807.json"),
        ("math", {"subset": "full"}, 5000, "math/0"),
        ("humaneval", {}, 164, "HumanEval/0"),
        ("mbpp", {}, 500, "mbpp/11"),
        ("mbpp", {"subset": "sanitized"}, 257, "mbpp/11"),
    ],
)
def test_load_counts_and_ids(name, kwargs, count, first_id):
    problems = get_task(name, **kwargs).load()
    assert len(problems) == count
    assert problems[0]["id"] == first_id
    assert len({p["id"] for p in problems}) == count
    assert len(get_task(name, **kwargs).load(limit=3)) == 3


def test_data_file_beats_the_data_dir_and_json_arrays_load(tmp_path):
    records = [{"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}]
    array_file = tmp_path / "tiny.json"
    array_file.write_text(json.dumps(records))
    problems = get_task("gsm8k", data_file=str(array_file)).load()
    assert [(p["id"], p["reference"]) for p in problems] == [("gsm8k/0", "4")]


def test_missing_local_file_falls_through_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("DLLM_DATA_DIR", str(tmp_path))
    with pytest.raises(data_module.DataError, match="must not reach the hub.*set DLLM_DATA_DIR to a folder holding "
                                                   "humaneval.jsonl"):  # the hub's error, with the way out
        get_task("humaneval").load()


def test_gsm8k_fewshot_prompt_is_deterministic_and_clean():
    task = get_task("gsm8k")
    problem = task.load(limit=1)[0]
    prompt = task.prompt(problem)
    assert prompt == get_task("gsm8k").prompt(problem)
    assert prompt.count("Question:") == 6 and prompt.endswith(format_qa_prompt(problem["question"]))
    assert "<<" not in prompt and prompt.count("#### ") == 5
    assert get_task("gsm8k", num_fewshot=0).prompt(problem) == format_qa_prompt(problem["question"])
    assert get_task("gsm8k", fewshot_seed=7).prompt(problem) != prompt
    messages = task.prompt(problem, chat=True)
    assert messages[0]["role"] == "user" and problem["question"] in messages[0]["content"]
    assert task.stop == ("Question:",) and get_task("gsm8k", chat=True).stop == ()


def test_qa_format_is_the_training_format():
    assert format_qa_prompt("What is 1+1?") == "Question: What is 1+1?\nAnswer:"
    assert format_example("What is 1+1?", "1+1=2\n#### 2").startswith(format_qa_prompt("What is 1+1?") + " ")
    assert strip_calculator_annotations("48/2 = <<48/2=24>>24") == "48/2 = 24"


# The GSM8K-style summary when every completion is its reference solution: right under every scorer.
ALL_CORRECT = {"accuracy": 1.0, "strict_accuracy": 1.0, "lm_eval_strict_match": 1.0, "lm_eval_flexible_extract": 1.0}


def test_gsm8k_reference_solutions_all_score():
    task = get_task("gsm8k")
    problems = task.load()
    scores = task.score_many(problems, [p["answer"] for p in problems])
    assert task.summarize(scores) == ALL_CORRECT


def test_gsm8k_score_cuts_at_the_next_question():
    task = get_task("gsm8k")
    problem = {"id": "x", "answer": "#### 18"}
    score = task.score(problem, " 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18\n\nQuestion: A farmer has 25 cows")
    assert score["correct"] and score["strict"] and score["id"] == "x"


def _math_reference_accuracy(subset, limit=None):
    task = get_task("math", subset=subset)
    problems = task.load(limit=limit)
    start = time.perf_counter()
    scores = task.score_many(problems, [p["solution"] for p in problems])
    return task.summarize(scores)["accuracy"], [s for s in scores if not s["correct"]], time.perf_counter() - start


def test_math500_reference_solutions_score():
    """All 500 solutions, through the boxed extraction and math-verify against the `answer` field (~3 s)."""
    accuracy, failures, _ = _math_reference_accuracy("500")
    assert accuracy >= 0.99, failures


@pytest.mark.slow
def test_full_math_reference_solutions_score():
    """All 5000 test solutions against their own last box: exercises parsing on every answer (~30 s)."""
    accuracy, failures, _ = _math_reference_accuracy("full")
    assert accuracy >= 0.99, failures[:10]


def test_full_math_reference_is_the_last_box():
    problems = get_task("math", subset="full").load(limit=20)
    assert all(p["reference"] and "\\boxed" in p["solution"] for p in problems)
    assert problems[0]["reference"] == "2"


def test_math_prompts_ask_for_a_box():
    task = get_task("math")
    problem = task.load(limit=1)[0]
    assert task.prompt(problem).startswith("Problem:\n") and "\\boxed{}" in task.prompt(problem)
    assert "\\boxed{}" in task.prompt(problem, chat=True)[0]["content"]


def test_math_score_with_final_answer_sentence():
    task = get_task("math")
    problem = {"id": "p", "reference": r"\frac{1}{2}"}
    assert task.score(problem, "Final Answer: The final answer is $0.5$. I hope it is correct.")["correct"]
    assert not task.score(problem, r"\boxed{\frac{1}{3}}")["correct"]


def _write_synthetic(path: Path) -> Path:
    rows = [
        {"question": "What is 12 + 30?", "answer": "12 + 30 = 42\n#### 42"},
        {"id": "s-7", "question": "What is 1,000 - 1?", "answer": "#### 999"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_synthetic_task_from_a_data_file(tmp_path):
    task = get_task("synthetic", data_file=str(_write_synthetic(tmp_path / "synthetic_test.jsonl")))
    problems = task.load()
    assert [p["id"] for p in problems] == ["synthetic/0", "s-7"]
    assert task.prompt(problems[0]) == "Question: What is 12 + 30?\nAnswer:"
    scores = task.score_many(problems, [" 12 + 30 = 42.\n#### 42", " It is 999."])
    assert [s["correct"] for s in scores] == [True, True] and [s["strict"] for s in scores] == [True, False]
    assert task.summarize(scores) == {
        "accuracy": 1.0,
        "strict_accuracy": 0.5,
        "lm_eval_strict_match": 0.5,
        "lm_eval_flexible_extract": 1.0,
    }


def test_synthetic_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="synthetic test set"):
        get_task("synthetic", data_file=str(tmp_path / "absent.jsonl")).load()


def test_packaged_synthetic_set_when_present():
    from dllm.eval.tasks.synthetic import synthetic_data_path

    if not synthetic_data_path().is_file():
        pytest.skip(f"packaged synthetic test set not generated yet ({synthetic_data_path()})")
    task = get_task("synthetic")
    problems = task.load()
    assert problems and all(p["reference"] is not None for p in problems)
    scores = task.score_many(problems, [p["answer"] for p in problems])
    assert task.summarize(scores) == ALL_CORRECT
