"""Scorers: GSM8K numeric match, MATH equivalence through math-verify, the pass@k estimator."""

import threading
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dllm.eval.scoring import (
    accuracy,
    estimate_pass_at_k,
    math_equal,
    pass_at_k,
    pass_at_k_by_problem,
    score_gsm8k,
    score_math,
)


def test_gsm8k_flexible_and_strict():
    score = score_gsm8k("She earns 9 * 2 = $18.00 a day.\n#### 18", "... #### 18")
    assert score == {"correct": True, "strict": True, "answer": "18", "strict_answer": "18", "reference": "18"}
    unformatted = score_gsm8k("So she makes $1,234 in all.", "#### 1234")
    assert unformatted["correct"] and not unformatted["strict"]
    wrong_last = score_gsm8k("#### 18\nCheck: 18 - 2 = 16", "#### 18")
    assert wrong_last["strict"] and not wrong_last["correct"]
    assert not score_gsm8k("", "#### 3")["correct"]


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
