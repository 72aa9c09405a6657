"""A safe evaluator for GSM8K calculator annotations (``<<48/2=24>>``) and checks on solutions.

The expression is parsed, never passed to ``eval``: only numbers, ``+ - * /``, unary minus and
parentheses are accepted, and arithmetic is exact (``Fraction``), so ``0.1+0.2=0.3`` checks out.
"""

import re
from fractions import Fraction

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([-+*/()]))")
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_FINAL = re.compile(r"^#### (\S+)$")


def _tokenize(expr: str) -> list[str]:
    """Split ``expr`` into numbers and operator characters; anything else is an error."""
    tokens, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"unexpected character {expr[pos:pos + 1]!r} in {expr!r}")
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
    return tokens


class _Parser:
    """Recursive descent over: sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("expression ends too early")
        self.pos += 1
        return token

    def sum(self) -> Fraction:
        value = self.product()
        while self._peek() in ("+", "-"):
            sign = 1 if self._take() == "+" else -1
            value += sign * self.product()
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            if self._take() == "*":
                value *= self.unary()
            else:
                divisor = self.unary()
                if divisor == 0:
                    raise ValueError("division by zero")
                value /= divisor
        return value

    def unary(self) -> Fraction:
        token = self._take()
        if token == "-":
            return -self.unary()
        if token == "(":
            value = self.sum()
            if self._take() != ")":
                raise ValueError("missing ')'")
            return value
        if token in "+*/)":
            raise ValueError(f"unexpected {token!r}")
        return Fraction(token)


def evaluate(expr: str) -> Fraction:
    """Exact value of an arithmetic expression such as ``"3*4+12/5"``; raises ``ValueError`` if malformed."""
    parser = _Parser(_tokenize(expr))
    value = parser.sum()
    if parser.pos != len(parser.tokens):
        raise ValueError(f"trailing input in {expr!r}")
    return value


def annotations(answer: str) -> list[tuple[str, str]]:
    """The ``(expression, stated value)`` pairs of every ``<<expr=value>>`` in a solution, in order."""
    return _ANNOTATION.findall(answer)


def final_answer(answer: str) -> str | None:
    """The ``N`` of a solution's last line ``#### N``, or ``None`` when the last line is not of that form."""
    match = _FINAL.match(answer.rsplit("\n", 1)[-1])
    return match.group(1) if match else None


def solution_errors(answer: str) -> list[str]:
    """Everything wrong with a synthetic solution: bad annotations, a missing or wrong ``#### N``.

    Checks that each annotation's expression evaluates to its stated value, that the value is repeated
    right after the ``>>`` (as GSM8K writes it), and that ``N`` equals the last annotation's value.
    """
    errors = []
    for expr, stated in annotations(answer):
        try:
            if evaluate(expr) != Fraction(stated):
                errors.append(f"{expr}={stated} is wrong")
        except ValueError as exc:
            errors.append(f"{expr}={stated}: {exc}")
        if f"<<{expr}={stated}>>{stated}" not in answer:
            errors.append(f"value {stated} not repeated after <<{expr}={stated}>>")
    final = final_answer(answer)
    if final is None:
        errors.append("last line is not '#### N'")
    elif annotations(answer) and final != annotations(answer)[-1][1]:
        errors.append(f"final answer {final} differs from the last computed value")
    return errors
