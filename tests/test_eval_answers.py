"""Answer extraction on hand-written completions in the formats that break naive extractors."""

import pytest

from dllm.eval.answers import (
    extract_boxed,
    extract_code_block,
    extract_final_answer_sentence,
    extract_last_number,
    extract_math_answer,
    extract_strict_number,
    gsm8k_reference,
    math_reference,
    normalize_number,
    truncate_at_stop,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", "1234"),
        ("$1,234.50", "1234.5"),
        ("18.00", "18"),
        ("18.0 dollars", "18"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("-7", "-7"),
        ("\u22127", "-7"),  # unicode minus sign
        ("-0", "0"),
        ("109,200,000", "109200000"),
        ("25%", "25"),
        ("no digits here", None),
        (None, None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("She pays $1,200.00 in total.", "1200"),
        ("5 apples and 3 pears make 8 fruits.", "8"),
        ("It weighs 12 kg.", "12"),
        ("The sides are 3,4,5", "5"),  # a list, not the number 345
        ("It costs $ 30.", "30"),
        ("He loses -4 points", "-4"),
        ("From 3-5 people, 2 came", "2"),
        ("Nothing numeric", None),
    ],
)
def test_last_number(completion, expected):
    assert extract_last_number(completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("48 / 2 = 24 clips.\n#### 72", "72"),
        ("#### $1,000.", "1000"),
        ("So the total is 10.\nThe answer is: $42.", "42"),
        ("the final answer is 7 apples", "7"),
        ("#### 5\nmore text 6\n#### 6", "5"),  # the first marked answer counts
        ("The total is 42.", None),
    ],
)
def test_strict_number(completion, expected):
    assert extract_strict_number(completion) == expected


def test_gsm8k_reference_reads_the_marked_number():
    assert gsm8k_reference("He had 2 + 3 = <<2+3=5>>5.\n#### 1,600") == "1600"
    assert gsm8k_reference("72") == "72"


def test_truncate_at_stop_cuts_at_the_earliest_stop():
    assert truncate_at_stop("a\nQuestion: b\n#", ("\n#", "Question:")) == "a\n"
    assert truncate_at_stop("abc", ()) == "abc"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box
        (r"\fbox{3}", "3"),
        (r"\boxed 5$", "5"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not grouping
        (r"\boxed{4} and an unclosed \boxed{\frac{1}{2}", "4"),  # cut-off box: fall back to the last complete one
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_final_answer_sentence():
    text = r"Final Answer: The final answer is $\frac{3}{4}$. I hope it is correct."
    assert extract_final_answer_sentence(text) == r"\frac{3}{4}"
    assert extract_final_answer_sentence("The final answer is 12.") == "12"
    assert extract_final_answer_sentence("no sentence") is None


def test_math_answer_prefers_the_box():
    assert extract_math_answer(r"The final answer is 3. Indeed $\boxed{4}$") == "4"
    assert extract_math_answer("The final answer is $x+1$.") == "x+1"


def test_math_reference_from_solution_or_answer():
    assert math_reference(r"Thus $x = \boxed{\dfrac{1}{4}}$.") == r"\dfrac{1}{4}"
    assert math_reference(r" \frac{1}{4} ") == r"\frac{1}{4}"


def test_code_block_extraction():
    chat = "Here you go:\n```python\ndef f(x):\n    return x\n```\nExplanation: ...\n```\nprint(f(1))\n```"
    assert extract_code_block(chat, must_contain="def f(") == "def f(x):\n    return x\n"
    assert extract_code_block(chat) == "def f(x):\n    return x\n"  # the longest python block
    assert extract_code_block("```py\nx = 1") == "x = 1"  # generation cut before the closing fence
    assert extract_code_block("```js\nlet x;\n```") == "let x;\n"  # only a non-python block: still code
    assert extract_code_block("    return x\n") is None  # a plain completion has no fence
