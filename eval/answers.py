"""Answer extraction: pull the final answer (a number, a LaTeX expression, a code block) out of a completion.

Every function here is pure string processing so the tasks, the `evaluate` metric modules and the tests
share one definition of "what the model answered".
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = [
    "count_boxes",
    "extract_boxed",
    "extract_code_block",
    "extract_final_answer_sentence",
    "extract_last_number",
    "extract_math_answer",
    "extract_stated_number",
    "extract_strict_number",
    "gsm8k_reference",
    "lm_eval_gsm8k_answer",
    "lm_eval_gsm8k_match",
    "math_reference",
    "normalize_number",
    "truncate_at_stop",
    "without_box_full_stops",
]

# A number as people write it in word problems: optional sign and currency, thousands separators only
# in groups of three (so "3,4,5" is three numbers, not 345), optional decimals. The lookbehind keeps
# "x2" or "1.2.3"-style fragments from yielding a number glued to a word.
_NUMBER = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\s?\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})")
_STRICT_RES = (
    re.compile(rf"####\s*({_NUMBER})"),
    re.compile(rf"(?i:the\s+(?:final\s+)?answer\s+is)\s*:?\s*({_NUMBER})"),
)
# An equation right after "The answer is N" (`5 + 3 = 8`): the statement's answer is its result, after the last `=`.
_EQUATION_RE = re.compile(rf"(?:\s*(?:[-+*/×÷=]|\\times|\\cdot)\s*(?:{_NUMBER}))+")
_FINAL_ANSWER_RE = re.compile(r"(?i:final\s+answer\s+is)\s*:?\s*(.+?)\s*(?:\.?\s*I hope|\n|$)")


def truncate_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> str:
    """Cut `text` at the earliest occurrence of any stop sequence (what a generation loop would do)."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def normalize_number(text: str | None) -> str | None:
    """Canonical decimal string for a written number: "$1,234.50" -> "1234.5", "18.00" -> "18".

    Returns None when `text` holds no number. Units and trailing words are ignored because only the
    leading numeric token is read.
    """
    if text is None:
        return None
    match = _NUMBER_RE.search(text.replace("\u2212", "-"))
    if match is None:
        return None
    digits = re.sub(r"[\s$,]", "", match.group(0))
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    # format(normalize()) drops trailing zeros without switching to exponent notation ("1.8E+2").
    canonical = format(value.normalize(), "f")
    return "0" if canonical in ("-0", "0") else canonical


def extract_last_number(text: str) -> str | None:
    """The last number in `text`, normalised (GSM8K's "flexible" answer)."""
    matches = _NUMBER_RE.findall(text.replace("\u2212", "-"))
    return normalize_number(matches[-1]) if matches else None


def extract_strict_number(text: str) -> str | None:
    """The number after the first `#### ` marker, else after the first "The answer is" (GSM8K's format)."""
    for pattern in _STRICT_RES:
        match = pattern.search(text.replace("\u2212", "-"))
        if match:
            return normalize_number(match.group(1))
    return None


# LaTeX that may wrap a boxed number: `\$`, thin spaces, `{,}` separators, `\%`, `\text{...}` units.
_BOX_NOISE_RE = re.compile(r"\\[$,!;% ]|\{,\}|\\(?:text|mathrm|mbox)\{[^{}]*\}|\^\\circ")
_BOXED_NUMBER_RE = re.compile(rf"\s*({_NUMBER})\s*\.?\s*")


def _boxed_number(content: str) -> str | None:
    r"""The number a `\boxed{}` holds (`\$1{,}200`, `13 \text{ apples}`, `4.`), None for an expression."""
    match = _BOXED_NUMBER_RE.fullmatch(_BOX_NOISE_RE.sub(lambda m: "," if m.group(0) == "{,}" else "", content))
    return normalize_number(match.group(1)) if match else None


def _equation_result(number: str, text: str, end: int) -> str | None:
    """The stated ``number`` (ending at ``end`` in ``text``), or the result of the equation it starts
    ("The answer is 5 + 3 = 8." states 8); an expression without `=` leaves the number as stated."""
    chain = _EQUATION_RE.match(text, end)
    if chain is None or "=" not in chain.group(0):
        return normalize_number(number)
    return normalize_number(_NUMBER_RE.findall(chain.group(0).rsplit("=", 1)[1])[0])


def extract_stated_number(text: str) -> str | None:
    r"""The answer a completion states explicitly, normalised; None when it states none.

    The first `#### N` wins (GSM8K's end-of-solution marker: what follows is the model running on);
    otherwise the last "The (final) answer is N" (the result when N starts an equation: "5 + 3 = 8") or
    numeric `\boxed{N}`, as a later statement corrects an earlier one. Text after the statement, numbers
    included, does not count.
    """
    text = text.replace("\u2212", "-")
    marked = _STRICT_RES[0].search(text)
    if marked:
        return normalize_number(marked.group(1))
    stated = [(m.start(), _equation_result(m.group(1), text, m.end())) for m in _STRICT_RES[1].finditer(text)]
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        content = _balanced_group(text, match.end() - 1)
        number = None if content is None else _boxed_number(content)
        if number is not None:
            stated.append((match.start(), number))
    return max(stated)[1] if stated else None


# lm-eval 0.4.13's `gsm8k` task (lm_eval/tasks/gsm8k/gsm8k.yaml): its two filters and its exact_match
# settings, written out here because lm-eval is an optional extra; tests/test_eval_scoring.py checks
# them against lm-eval's own filters and metric, so published lm-eval numbers can be compared.
_LM_EVAL_FILTERS = {
    "strict-match": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),  # first match
    "flexible-extract": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),  # last match
}
_LM_EVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")  # removed from both sides, in this order
LM_EVAL_FALLBACK = "[invalid]"


def lm_eval_gsm8k_answer(text: str, filter_name: str) -> str:
    """What lm-eval's gsm8k `strict-match` or `flexible-extract` filter extracts ("[invalid]" if nothing)."""
    pattern, group_select = _LM_EVAL_FILTERS[filter_name]
    matches = pattern.findall(text)
    if not matches:
        return LM_EVAL_FALLBACK
    match = matches[group_select]
    if isinstance(match, tuple):  # several groups: the first non-empty one
        match = next((group for group in match if group), LM_EVAL_FALLBACK)
    return match.strip()


def lm_eval_gsm8k_match(text: str, reference: str, filter_name: str) -> bool:
    """lm-eval's gsm8k exact_match for one completion under one filter, against the full gold solution."""
    prediction = lm_eval_gsm8k_answer(text, filter_name)
    for pattern in _LM_EVAL_IGNORE:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    return prediction.lower() == reference.lower()


def gsm8k_reference(answer: str) -> str | None:
    """The gold number of a GSM8K solution (text after its last `####`), or of a bare number string."""
    return normalize_number(answer.rsplit("####", 1)[-1])


def _balanced_group(text: str, open_index: int) -> str | None:
    """Content of the `{...}` group opening at `open_index`, honouring nesting; None if unclosed."""
    depth = 0
    for index in range(open_index, len(text)):
        char = text[index]
        if char == "{" and text[index - 1 : index] != "\\":
            depth += 1
        elif char == "}" and text[index - 1 : index] != "\\":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


# A full stop a model puts inside the box (`\boxed{4.}`): punctuation, not part of the answer. Only
# after a digit, letter or closing brace, so an ellipsis (`1, 2, \ldots` or `...`) is kept.
_BOX_FULL_STOP_RE = re.compile(r"(?<=[\w}])\s*\.\s*$")


def _boxes(text: str) -> list[tuple[int, int, str]]:
    r"""Every complete `\boxed{...}` / `\fbox{...}` (balanced braces) or `\boxed 5`: (start, end, content)."""
    boxes = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*(\{|\s[^\s$]+)", text):
        if match.group(1) != "{":
            boxes.append((match.start(), match.end(), match.group(1).strip()))
            continue
        content = _balanced_group(text, match.start(1))
        if content is not None:
            end = match.start(1) + len(content) + 2
            boxes.append((match.start(), end, _BOX_FULL_STOP_RE.sub("", content.strip())))
    return boxes


def count_boxes(text: str) -> int:
    r"""How many complete `\boxed{}` / `\fbox{}` answers `text` holds."""
    return len(_boxes(text))


def without_box_full_stops(text: str) -> str:
    r"""`text` with a full stop at the end of each box's content removed (`\boxed{4.}` -> `\boxed{4}`)."""
    pieces, last = [], 0
    for start, end, content in _boxes(text):
        pieces += [text[last:start], f"\\boxed{{{content}}}"]
        last = end
    return "".join(pieces) + text[last:]


def extract_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` or `\fbox{...}` (balanced braces); also `\boxed 5`.

    A full stop ending the content is dropped (`\boxed{4.}` -> "4"); a cut-off last box is skipped.
    """
    boxes = _boxes(text)
    return boxes[-1][2] if boxes else None


def extract_final_answer_sentence(text: str) -> str | None:
    """The expression in the last "The final answer is X" sentence, with surrounding `$` removed."""
    matches = _FINAL_ANSWER_RE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip().rstrip(".").strip()
    return answer.strip("$").strip() or None


def extract_math_answer(text: str) -> str | None:
    r"""A MATH completion's answer: the last `\boxed{}`/`\fbox{}`, else a final-answer sentence."""
    return extract_boxed(text) or extract_final_answer_sentence(text)


def math_reference(reference: str) -> str:
    r"""The gold answer of a MATH record: its last `\boxed{}` when given a full solution, else as is."""
    return extract_boxed(reference) or reference.strip()


_FENCE_RE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code_block(text: str, must_contain: str | None = None) -> str | None:
    """The Python code of a fenced block in a chat completion; None when there is no fence.

    Prefers blocks tagged python (or untagged), and among them the first containing `must_contain`
    (e.g. `def entry_point(`), else the longest one. An unterminated last fence (generation cut off)
    still counts.
    """
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]
    python_blocks = [body for lang, body in blocks if lang in ("", "python", "py", "python3")]
    candidates = python_blocks or [body for _, body in blocks]
    if not candidates:
        return None
    if must_contain is not None:
        for body in candidates:
            if must_contain in body:
                return body
    return max(candidates, key=len)
