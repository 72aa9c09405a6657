"""Tests for dllm.data: the synthetic generator, the held-out set, GSM8K mixing and the tokenizer."""

import hashlib
import json
import re
from dataclasses import replace
from fractions import Fraction
from importlib import resources
from itertools import islice
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from dllm.data import (
    HELDOUT_SEED,
    PRESETS,
    ProblemConfig,
    annotations,
    build_heldout,
    evaluate,
    final_answer,
    format_example,
    generate,
    heldout_set,
    load_gsm8k_train,
    mixed_stream,
    solution_errors,
    training_stream,
)
from dllm.data.tokenizer import BOS, EOS, MASK, PAD, load_tokenizer, train_tokenizer

# Changing the generator or this file changes the benchmark: regenerate with
# `python -m dllm.data --write-heldout` only on purpose, then update this hash.
HELDOUT_SHA256 = "bbe6511aa092a4b4b12f3d8f9bd0e90b4b2bdc77458e5554fbea0096d6ef59c8"
# shared/data beside the repository (CI has it; a fresh clone does not, and the test then skips)
GSM8K_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_train.jsonl"


# ---- safe evaluator ----

@pytest.mark.parametrize("expr, value", [
    ("3*4", 12), ("48/2", 24), ("100-50-30-15", 5), ("2+3*4", 14), ("(2+3)*4", 20),
    ("-3+5", 2), ("0.2*50", 10), ("12/60", Fraction(1, 5)), ("8/4/2", 1), (" 7 + 1 ", 8),
])
def test_evaluate_hand_cases(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "2**3", "1/0", "2+", "3 4", "(1+2", "", "1e3", "x*2"])
def test_evaluate_rejects_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        evaluate(expr)


def test_solution_errors_catches_each_kind_of_mistake():
    assert solution_errors("He has 2+2=<<2+2=4>>4 pens.\n#### 4") == []
    assert solution_errors("He has 2+2=<<2+2=5>>5 pens.\n#### 5")  # wrong arithmetic
    assert solution_errors("He has 2+2=<<2+2=4>>5 pens.\n#### 4")  # value not repeated
    assert solution_errors("He has 2+2=<<2+2=4>>4 pens.\n#### 5")  # final differs
    assert solution_errors("He has 2+2=<<2+2=4>>4 pens.")  # no final line


# ---- generator ----

def test_format_example():
    assert format_example("Q?") == "Question: Q?\nAnswer:"
    assert format_example("Q?", "A\n#### 1") == "Question: Q?\nAnswer: A\n#### 1"


def test_generation_is_deterministic_given_seed():
    assert generate(200, seed=3) == generate(200, seed=3) == list(islice(training_stream(3), 200))
    assert generate(200, seed=3) != generate(200, seed=4)
    hard = PRESETS["hard"]
    assert generate(50, seed=3, config=hard) == generate(50, seed=3, config=hard)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_problems_are_well_formed(name):
    config = PRESETS[name]
    for problem in generate(1000, seed=11, config=config):
        assert set(problem) == {"question", "answer"}
        assert problem["question"].endswith("?") and "\n" not in problem["question"]
        assert solution_errors(problem["answer"]) == [], problem
        assert re.fullmatch(r"#### \d+", problem["answer"].splitlines()[-1])
        steps = annotations(problem["answer"])
        assert config.min_steps <= len(steps) <= config.max_steps
        values = [Fraction(value) for _, value in steps]
        assert all(1 <= v <= config.max_value and v.denominator == 1 for v in values)
        assert Fraction(final_answer(problem["answer"])) == values[-1]


def test_non_integer_config_gives_exact_two_decimal_results():
    config = ProblemConfig(ops=("/", "*"), max_factor=8, integer_only=False)
    problems = generate(500, seed=5, config=config)
    assert all(solution_errors(p["answer"]) == [] for p in problems)
    assert any("." in final_answer(p["answer"]) for p in problems)


def test_config_knobs_are_respected():
    config = ProblemConfig(ops=("+",), n_names=2, max_steps=1, n_objects=1, n_templates=1)
    problems = generate(300, seed=0, config=config)
    assert all(annotations(p["answer"])[0][0].count("+") == 1 for p in problems)
    assert {p["question"].split()[-2] for p in problems} <= {"Tom", "Anna"}  # "... does Tom have?"
    assert all(" more apple" in p["question"] for p in problems)


@pytest.mark.parametrize("change", [
    dict(min_steps=0), dict(min_steps=3, max_steps=2), dict(ops=()), dict(ops=("+", "+")),
    dict(ops=("^",)), dict(max_factor=1), dict(max_value=3), dict(n_templates=0),
    dict(n_names=3), dict(n_objects=0),
])
def test_invalid_config_is_refused(change):
    with pytest.raises(ValueError):
        replace(ProblemConfig(), **change)


# ---- held-out set ----

def test_heldout_file_is_stable_and_reproducible():
    data = resources.files("dllm.data").joinpath("synthetic_test.jsonl").read_bytes()
    assert hashlib.sha256(data).hexdigest() == HELDOUT_SHA256
    heldout = heldout_set()
    assert len(heldout) == 500 and len({p["question"] for p in heldout}) == 500
    assert heldout == build_heldout()


def test_training_stream_never_yields_heldout_questions():
    heldout = {p["question"] for p in heldout_set()}
    assert heldout.isdisjoint(p["question"] for p in generate(20_000, seed=0))
    # At the held-out seed the unfiltered stream starts with exactly the held-out problems,
    # so this only passes if the filter really removes them.
    assert heldout.isdisjoint(p["question"] for p in generate(500, seed=HELDOUT_SEED))


# ---- GSM8K mixing ----

@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "TEST.jsonl", "my_test_split.jsonl"])
def test_gsm8k_test_file_is_refused(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="test"):
        load_gsm8k_train(path)


@pytest.mark.parametrize("split", ["test", "test[:10]", "train+test"])
def test_gsm8k_test_split_is_refused(split):
    with pytest.raises(ValueError, match="test"):  # refused before any download is tried
        load_gsm8k_train(split=split)


def test_gsm8k_mixing(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"g{i}", "answer": "#### 1"}) + "\n" for i in range(5)))
    gsm8k = load_gsm8k_train(path)
    assert gsm8k[0] == {"question": "g0", "answer": "#### 1"}

    def take(stream, n=400):
        return [next(stream) for _ in range(n)]

    assert take(mixed_stream(2, gsm8k, 0.0)) == generate(400, seed=2)
    assert all(p in gsm8k for p in take(mixed_stream(2, gsm8k, 1.0)))
    mixed = take(mixed_stream(2, gsm8k, 0.5))
    assert mixed == take(mixed_stream(2, gsm8k, 0.5))
    n_gsm8k = sum(p in gsm8k for p in mixed)
    assert 150 < n_gsm8k < 250  # Binomial(400, 0.5): this range is about +-5 standard deviations
    assert [p for p in mixed if p not in gsm8k] == generate(400 - n_gsm8k, seed=2)
    with pytest.raises(ValueError):
        mixed_stream(2, gsm8k, 1.5).__next__()


@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason=f"needs {GSM8K_TRAIN} (shared/data beside the repository)")
def test_gsm8k_local_train_file_loads():
    records = load_gsm8k_train(GSM8K_TRAIN)
    assert len(records) == 7473 and all(final_answer(r["answer"]) for r in records)


# ---- tokenizer ----

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [format_example(p["question"], p["answer"]) for p in generate(3000, seed=0)]
    return train_tokenizer(texts, vocab_size=1000, out_path=tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _sample_texts():
    texts = [format_example(p["question"], p["answer"]) for p in heldout_set()[:200]]
    texts += [format_example(p["question"]) for p in generate(50, seed=9, config=PRESETS["hard"])]
    return texts + ["  odd  spacing\tand\nnew lines ", "unseen: é ∑ 🙂 $3.50 100%", ""]


def test_tokenizer_round_trip_is_exact(tokenizer):
    for text in _sample_texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_one_per_token(tokenizer):
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]
    for text in _sample_texts():
        for token in tokenizer.tokenize(text):
            assert not re.search(r"\d", token) or len(token) == 1, token


def test_tokenizer_special_tokens(tokenizer):
    expected = {"pad": PAD, "eos": EOS, "mask": MASK, "bos": BOS}
    ids = {role: tokenizer.convert_tokens_to_ids(token) for role, token in expected.items()}
    assert ids == {"pad": 0, "eos": 1, "mask": 2, "bos": 3}
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == (0, 1, 2)
    assert tokenizer(f"Answer: {MASK}{MASK}{EOS}", add_special_tokens=False)["input_ids"][-3:] == [2, 2, 1]
    # Nothing (BOS, EOS) is added on encode: the trainer decides.
    assert tokenizer("Answer: 7")["input_ids"] == tokenizer.encode("Answer: 7", add_special_tokens=False)


def test_tokenizer_file_loads_through_transformers(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.backend_tokenizer.save(str(path))
    plain = PreTrainedTokenizerFast(tokenizer_file=str(path))
    loaded = load_tokenizer(path)
    text = _sample_texts()[0]
    assert plain(text)["input_ids"] == loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert isinstance(loaded, PreTrainedTokenizerFast) and loaded.mask_token == MASK


def test_difficulty_report(tokenizer):
    from dllm.data.study import difficulty_report, format_report

    report = difficulty_report(tokenizer, PRESETS["default"], n=300)
    assert set(report["steps"]) == {1, 2, 3} and sum(report["steps"].values()) == 300
    assert 1 <= report["answer_min"] <= report["answer_median"] <= report["answer_max"] <= 100
    lengths = report["example_tokens"]
    assert lengths["mean"] > report["question_tokens"]["mean"] + report["answer_tokens"]["mean"]
    assert "steps: 1 " in format_report(report)


def test_step_templates_alternate_actions_and_comparisons():
    from dllm.data.templates import STEPS, _alternate

    for templates in STEPS.values():
        assert [t.new_owner for t in templates] == [i % 2 == 1 for i in range(len(templates))]
        assert all(t.solution == ("{f} has {calc}." if t.new_owner else "{n} now has {calc}.") for t in templates)
    with pytest.raises(ValueError, match="2 actions cannot alternate with 0 comparisons"):
        _alternate(("a", "b"), ())
