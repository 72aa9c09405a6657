"""Scorers: GSM8K numeric match, MATH equivalence through math-verify, the pass@k estimator."""

import threading
from math import comb
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm.eval.scoring import (
    accuracy,
    estimate_pass_at_k,
    math_equal,
    pass_at_k,
    pass_at_k_by_problem,
    score_gsm8k,
    score_math,
    summarize_gsm8k,
)


def test_gsm8k_flexible_and_strict():
    score = score_gsm8k("She earns 9 * 2 = $18.00 a day.\n#### 18", "... #### 18")
    assert score == {
        "correct": True,
        "strict": True,
        "answer": "18",
        "strict_answer": "18",
        "reference": "18",
        "lm_eval_strict": True,
        "lm_eval_flexible": True,
    }
    unformatted = score_gsm8k("So she makes $1,234 in all.", "#### 1234")
    assert unformatted["correct"] and not unformatted["strict"]
    checked = score_gsm8k("#### 18\nCheck: 18 - 2 = 16", "#### 18")  # the stated answer, not the check
    assert checked["strict"] and checked["correct"] and not checked["lm_eval_flexible"]
    assert not score_gsm8k("", "#### 3")["correct"]


# A stated answer followed by text with numbers: lm-eval's flexible filter (last number) scores these
# wrong; the stated answer is 13 in every one.
STATED_THEN_NUMBERS = [
    "4 + 9 = 13 apples.\n#### 13\nand it took 3 steps",
    "4 + 9 = 13. The answer is 13. Send me 1 more problem!",
    "She has 4 + 9 = 13.\nThe final answer is: 13\n\n(2 of 2 checks passed)",
    r"Adding, $4 + 9 = \boxed{13}$. I used 2 numbers.",
    r"So $\boxed{\$13}$ in total, 1 answer.",
    "#### 13\n\nQuestion 2: what is 5 + 7? 12",
    "The answer is $13.00. That is 1300 cents.",
    "First 12, no wait. The answer is 13, from 4 + 9 = 13 in step 2.",
]


@pytest.mark.parametrize("completion", STATED_THEN_NUMBERS)
def test_gsm8k_prefers_the_stated_answer_to_later_numbers(completion):
    score = score_gsm8k(completion, "4 + 9 = 13\n#### 13")
    assert (score["correct"], score["answer"]) == (True, "13")
    assert not score["lm_eval_flexible"]  # lm-eval's last-number rule, kept as its own metric


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("4 + 9 = 13 apples in all.", "13"),  # no statement: the last number
        ("I get 12, or maybe 13", "13"),
        (r"The sum is $\boxed{\frac{26}{2}}$ or 13", "13"),  # a box that holds no plain number
        ("The answer is 12.\nWait, I made an error. The answer is 13.", "13"),  # the last statement
        ("#### 13\nThe answer is 12", "13"),  # `####` ends a GSM8K solution: its first one wins
        ("No numbers at all", None),
        ("The answer is 4 + 9 = 13.", "13"),  # a statement that is an equation states its result
        ("The answer is 26 / 2 = 13 apples. I checked 2 times.", "13"),
        (r"The answer is 2 \times 6.5 = 13", "13"),
        ("The answer is 13, from 4 + 9 = 12 + 1.", "13"),  # the equation is not the statement's
        ("The answer is 13 + 0", "13"),  # an expression without a result: the number as stated
    ],
)
def test_gsm8k_answer_rules(completion, answer):
    assert score_gsm8k(completion, "#### 13")["answer"] == answer


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", r"\frac12"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        ("x(x+2)", "x^2+2x"),
        (r"10^\circ", "10"),
        (r"\text{Monday}", r"\text{Monday}"),
    ],
)
def test_math_equal_accepts_equivalent_forms(prediction, reference):
    assert math_equal(prediction, reference)


@pytest.mark.parametrize(("prediction", "reference"), [("3", "2"), (r"\sqrt{2}", "1.414"), (None, "1"), ("", "1")])
def test_math_equal_rejects_different_values(prediction, reference):
    assert not math_equal(prediction, reference)


def test_score_math_extracts_then_verifies():
    score = score_math(r"We get $\frac{2}{4}$, so the answer is $\boxed{\frac{1}{2}}$.", "0.5")
    assert score == {"correct": True, "answer": r"\frac{1}{2}", "reference": "0.5"}
    assert score_math(r"Thus \boxed{7}.", r"Solution text with \boxed{7}")["correct"]
    assert not score_math("I do not know.", "7")["correct"]


def test_math_equal_off_the_main_thread():
    """math-verify's SIGALRM timeout only works on the main thread; elsewhere we run without it."""
    results = []
    worker = threading.Thread(target=lambda: results.append(math_equal("0.25", r"\frac{1}{4}")))
    worker.start()
    worker.join()
    assert results == [True]


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_the_binomial_formula(case):
    n, c, k = case
    exact = 1.0 - comb(n - c, k) / comb(n, k)
    assert estimate_pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_edges():
    assert estimate_pass_at_k(200, 0, 100) == 0.0
    assert estimate_pass_at_k(200, 101, 100) == 1.0  # fewer than k failures: some k-subset passes
    assert estimate_pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="pass@5"):
        estimate_pass_at_k(3, 1, 5)
    assert pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)


def test_pass_at_k_by_problem_groups_samples_and_skips_infeasible_k():
    ids = ["a", "a", "b", "b"]
    result = pass_at_k_by_problem(ids, [True, False, False, False], ks=(1, 2, 10))
    assert result == {"pass@1": pytest.approx(0.25), "pass@2": pytest.approx(0.5)}


def test_accuracy():
    assert accuracy([True, False, True, True]) == 0.75
    assert accuracy([]) == 0.0


def _lm_eval_gsm8k(completions: list[str], reference: str) -> dict[str, list[bool]]:
    """lm-eval's own gsm8k scoring: its task YAML's filters and exact_match settings, run by lm-eval."""
    yaml = pytest.importorskip("yaml")
    lm_eval = pytest.importorskip("lm_eval.filters")  # importing the filters registers them
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.api.registry import get_filter

    config = yaml.safe_load((Path(lm_eval.__file__).parents[1] / "tasks/gsm8k/gsm8k.yaml").read_text())
    (metric,) = config["metric_list"]
    options = {k: metric[k] for k in ("ignore_case", "ignore_punctuation", "regexes_to_ignore")}
    results = {}
    for pipeline in config["filter_list"]:
        responses = [[c] for c in completions]
        for step in pipeline["filter"]:
            kwargs = {k: v for k, v in step.items() if k != "function"}
            responses = list(get_filter(step["function"])(**kwargs).apply(responses, [{}] * len(completions)))
        results[pipeline["name"]] = [
            exact_match_hf_evaluate(predictions=[p], references=[reference], **options)["exact_match"] == 1.0
            for p in responses
        ]
    return results


FRAGMENTS = [
    "#### ",
    "#### 13",
    "The answer is 13",
    "13",
    "13.",
    "1,3",
    "$13",
    "-13",
    "1.3",
    ",",
    ".",
    "$",
    " ",
    "\n",
    "Question:",
    "x",
    "12",
    "-",
    "0.5",
    "1,300",
    "####13",
    "#### -1.",
    "So",
    r"\boxed{13}",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join), st.sampled_from(["13", "-1", "1,300"]))
def test_lm_eval_metrics_match_lm_eval_itself(completion, gold):
    """Our lm_eval_strict / lm_eval_flexible equal lm-eval 0.4.13's gsm8k filters + exact_match."""
    reference = f"Some working 4 + 9.\n#### {gold}"
    expected = _lm_eval_gsm8k([completion], reference)
    score = score_gsm8k(completion, reference)
    assert score["lm_eval_strict"] == expected["strict-match"][0]
    assert score["lm_eval_flexible"] == expected["flexible-extract"][0]


def test_lm_eval_metrics_on_the_adversarial_completions():
    reference = "4 + 9 = 13\n#### 13"
    expected = _lm_eval_gsm8k(STATED_THEN_NUMBERS, reference)
    scores = [score_gsm8k(c, reference) for c in STATED_THEN_NUMBERS]
    assert [s["lm_eval_strict"] for s in scores] == expected["strict-match"]
    assert [s["lm_eval_flexible"] for s in scores] == expected["flexible-extract"] == [False] * len(scores)
    summary = summarize_gsm8k(scores)
    assert summary["accuracy"] == 1.0 and summary["lm_eval_flexible_extract"] == 0.0
    assert summary["lm_eval_strict_match"] == pytest.approx(sum(expected["strict-match"]) / len(scores))
    old_rows = [{"correct": True, "strict": False}]  # rows scored before the lm-eval metrics existed
    assert summarize_gsm8k(old_rows) == {"accuracy": 1.0, "strict_accuracy": 0.0}


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"the integers are $\boxed{1}$ and $\boxed{-2}$", "1,-2"),
        (r"So $x = \boxed{3}$ or $x = \boxed{5}$.", "3, 5"),
        (r"The roots are $\boxed{\frac{1}{2}}$, $\boxed{-3}$.", r"-3, \frac12"),
        (r"First $\boxed{1}$. Then, correcting the sign, $\boxed{2}$.", "2"),  # a later sentence's box
    ],
)
def test_math_several_boxes_read_as_math_verify_reads_the_whole_completion(completion, reference):
    from math_verify import parse, verify

    assert verify(parse(f"${reference}$"), parse(completion))  # the independent reading: math-verify itself
    assert score_math(completion, reference)["correct"]


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"the integers are $\boxed{1}$ and $\boxed{-2}$", "1"),  # half an answer is wrong
        (r"the integers are $\boxed{1}$ and $\boxed{-2}$", "-2"),
        (r"First $\boxed{1}$. Then, correcting the sign, $\boxed{2}$.", "1"),
        (r"$\boxed{1}$ and $\boxed{2}$", "1, 2, 3"),
    ],
)
def test_math_several_boxes_wrong_answers_stay_wrong(completion, reference):
    assert not score_math(completion, reference)["correct"]


def test_math_full_stop_inside_the_box():
    assert score_math(r"so the answer is $\boxed{4.}$", "4") == {"correct": True, "answer": "4", "reference": "4"}
    assert score_math(r"$\boxed{\frac{1}{2}.}$", "0.5")["correct"]
    assert score_math(r"$\boxed{3.}$ and $\boxed{4.}$", "3, 4")["correct"]
    assert not score_math(r"so $\boxed{4.}$", "5")["correct"]
    assert score_math(r"$\boxed{4.5}$", "4.5")["correct"] and not score_math(r"$\boxed{4.5}$", "4")["correct"]


def test_math_solution_that_boxes_several_answers_is_all_of_them():
    """A full-MATH gold solution is read like a completion (lm-eval's minerva reads its gold with math-verify)."""
    solution = r"Both check out. Therefore, the answers are $\boxed{-2}$ and $\boxed{1}$."
    assert score_math(r"So $x = \boxed{1}$ or $x = \boxed{-2}$.", solution)["correct"]
    assert not score_math(r"So $x = \boxed{1}$.", solution)["correct"]  # the last box alone is half the answer
    assert score_math(r"So $x = \boxed{7}$.", r"Hence $\boxed{7.}$")["correct"]


def test_math_task_reads_a_full_solution_gold_whole():
    from dllm.eval import get_task

    task = get_task("math", subset="full")
    solution = r"Therefore, the answers are $\boxed{-2}$ and $\boxed{1}$."
    problem = {"id": "math/414", "solution": solution, "reference": "1"}  # `reference`: its last box
    assert task.score(problem, r"The solutions are $\boxed{-2}$ and $\boxed{1}$.")["correct"]
    assert not task.score(problem, r"$\boxed{1}$")["correct"]
    math500 = {"id": "m", "answer": "-2, 1", "solution": solution, "reference": "-2, 1"}
    assert get_task("math").score(math500, r"$\boxed{1}$ and $\boxed{-2}$")["correct"]
