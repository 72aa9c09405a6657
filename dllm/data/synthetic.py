"""Procedural arithmetic word problems in GSM8K's format, for training tiny models offline.

A record is ``{"question": ..., "answer": ...}`` exactly like a line of GSM8K's JSONL: the answer has one
line per step with a ``<<expr=value>>`` calculator annotation and ends with ``#### N``. Example::

    question: Tom has 3 bags with 4 apples each. Tom gives 5 apples to Sam. How many apples does Tom have?
    answer:   Tom has 3*4=<<3*4=12>>12 apples.
              Tom now has 12-5=<<12-5=7>>7 apples.
              #### 7

A story follows one running count ``x`` (what its current owner has). Each step applies ``x op b``,
either as an action ("Tom sells 5 apples") or as a comparison that moves the count to a new person
("Sam has 3 times as many apples as Tom"). Everything is drawn from ``random.Random(seed)``.

Held-out set: ``synthetic_test.jsonl`` holds the first ``HELDOUT_SIZE`` distinct problems drawn with
``HELDOUT_SEED`` at the default preset. ``training_stream`` drops every problem whose question string
equals a held-out question (exact match), whatever its seed or config, so the two never overlap.
The file, not the code, is the benchmark: ``python -m dllm.data --write-heldout`` rewrites it.

Prompt format (shared by training and evaluation, see ``format_example``)::

    Question: {question}
    Answer: {answer}
"""

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from itertools import islice
from pathlib import Path

from dllm.data.templates import (
    CONTAINERS,
    FINAL_QUESTION,
    GROUP_STARTS,
    NAMES,
    OBJECTS,
    PLAIN_STARTS,
    STEPS,
    Template,
)

OPS = ("+", "-", "*", "/")
HELDOUT_SEED = 8_675_309
HELDOUT_SIZE = 500
HELDOUT_FILE = "synthetic_test.jsonl"


@dataclass(frozen=True)
class ProblemConfig:
    """Difficulty knobs. The defaults are sized for a ~3M-parameter model trained for minutes on a CPU."""

    min_steps: int = 1
    max_steps: int = 3
    ops: tuple[str, ...] = OPS
    max_operand: int = 20  # largest starting count and largest number added or taken away
    max_factor: int = 9  # largest multiplier, divisor and group size
    max_value: int = 100  # no count in a story, intermediate or final, exceeds this
    integer_only: bool = True  # division divides evenly; otherwise results may have 2 decimals
    n_templates: int = 5  # sentence templates in use per operation (story variety)
    n_names: int = len(NAMES)
    n_objects: int = len(OBJECTS)

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if not self.ops or len(set(self.ops)) != len(self.ops) or not set(self.ops) <= set(OPS):
            raise ValueError(f"ops must be distinct members of {OPS}, got {self.ops}")
        if self.max_operand < 2 or self.max_factor < 2:
            raise ValueError(f"max_operand and max_factor must be >= 2, got {self.max_operand}, "
                             f"{self.max_factor}")
        if self.max_value < max(4, self.max_operand):
            raise ValueError(f"max_value must be >= max(4, max_operand), got {self.max_value}")
        if self.n_templates < 1:
            raise ValueError(f"n_templates must be >= 1, got {self.n_templates}")
        # Each step may bring in one new person, and all people in a story are distinct.
        if not self.max_steps + 1 <= self.n_names <= len(NAMES):
            raise ValueError(f"n_names must be in [max_steps + 1, {len(NAMES)}], got {self.n_names}")
        if not 1 <= self.n_objects <= len(OBJECTS):
            raise ValueError(f"n_objects must be in [1, {len(OBJECTS)}], got {self.n_objects}")


PRESETS: dict[str, ProblemConfig] = {
    "easy": ProblemConfig(min_steps=1, max_steps=2, ops=("+", "-"), max_operand=10, max_value=20),
    "default": ProblemConfig(),
    "medium": ProblemConfig(min_steps=2, max_steps=4, max_operand=50, max_factor=12, max_value=500),
    "hard": ProblemConfig(min_steps=3, max_steps=4, max_operand=100, max_factor=20, max_value=2000),
}


def format_example(question: str, answer: str | None = None) -> str:
    """The canonical text of an example: ``"Question: {question}\\nAnswer: {answer}"``.

    With ``answer=None`` this is the prompt, ending in ``"Answer:"``; the model's completion is then
    ``" " + answer`` (the space belongs to the completion). End-of-sequence tokens are the trainer's job.
    """
    prompt = f"Question: {question}\nAnswer:"
    return prompt if answer is None else f"{prompt} {answer}"


def _fmt(value: Fraction) -> str:
    """``12`` for integers, ``2.5`` for the 2-decimal values non-integer configs allow."""
    if value.denominator == 1:
        return str(value.numerator)
    cents = value * 100
    assert cents.denominator == 1, value  # _operands only admits results with at most 2 decimals
    whole, frac = divmod(cents.numerator, 100)
    return f"{whole}.{frac:02d}".rstrip("0")


class _Story:
    """The state of a story being written: who owns the count, its value, and the text so far."""

    def __init__(self, rng: random.Random, config: ProblemConfig) -> None:
        self.rng, self.config = rng, config
        self.people = rng.sample(NAMES[: config.n_names], config.max_steps + 1)
        self.owner = self.people.pop()
        self.obj = rng.choice(OBJECTS[: config.n_objects])
        self.box = rng.choice(CONTAINERS)
        self.x = Fraction(0)
        self.sentences: list[str] = []
        self.lines: list[str] = []

    def count(self, value: Fraction) -> str:
        """A number with its noun: "1 apple", "12 apples"."""
        return f"{_fmt(value)} {self.obj[0] if value == 1 else self.obj[1]}"

    def fields(self, **extra: object) -> dict[str, object]:
        """Values for every template placeholder (``str.format`` ignores the unused ones)."""
        name, pronoun = self.owner
        return dict(n=name, he=pronoun, x=_fmt(self.x), obj=self.obj[1], box=self.box[0],
                    boxes=self.box[1], **extra)

    def apply(self, op: str, b: int, template: Template) -> None:
        """Add one step ``x op b``: the question sentence and its annotated solution line."""
        result = {"+": self.x + b, "-": self.x - b, "*": self.x * b, "/": self.x / b}[op]
        expr = f"{_fmt(self.x)}{op}{b}"
        calc = f"{expr}=<<{expr}={_fmt(result)}>>{self.count(result)}"
        other = self.people.pop() if "{f}" in template.question else ("", "")
        question = template.question.format(**self.fields(b=b, bx=self.count(Fraction(b)), f=other[0]))
        self.sentences.append(question)
        self.lines.append(template.solution.format(**self.fields(calc=calc, f=other[0])))
        if template.new_owner:
            self.owner = other
        self.x = result

    def record(self) -> dict[str, str]:
        """The finished problem as a GSM8K-style record."""
        question = " ".join([*self.sentences, FINAL_QUESTION.format(**self.fields())])
        return {"question": question, "answer": "\n".join([*self.lines, f"#### {_fmt(self.x)}"])}


def _operands(op: str, x: Fraction, config: ProblemConfig) -> list[int]:
    """Every ``b`` for which ``x op b`` keeps the story valid: counts stay in [1, max_value]."""
    if op == "+":
        return list(range(1, min(config.max_operand, int(config.max_value - x)) + 1))
    if op == "-":
        return list(range(1, min(config.max_operand, int(x - 1)) + 1))
    if op == "*":
        return [b for b in range(2, config.max_factor + 1) if x * b <= config.max_value]
    # Division: exact when integer_only, else the result may have at most two decimals.
    ok_denominators = (1,) if config.integer_only else (1, 2, 4, 5, 10, 20, 25, 50, 100)
    return [b for b in range(2, config.max_factor + 1)
            if (x / b).denominator in ok_denominators and x / b >= 1]


def _start(story: _Story) -> int:
    """Open the story with a plain count or with groups (a ``*`` step); returns the steps used."""
    rng, config = story.rng, story.config
    if rng.choice(config.ops) == "*":
        story.x = Fraction(rng.randint(2, config.max_factor))
        b = rng.choice(_operands("*", story.x, config))
        story.apply("*", b, rng.choice(GROUP_STARTS[: config.n_templates]))
        return 1
    story.x = Fraction(rng.randint(2, config.max_operand))
    story.sentences.append(rng.choice(PLAIN_STARTS[: config.n_templates]).format(
        **story.fields(bx=story.count(story.x))))
    return 0


def _try_problem(rng: random.Random, config: ProblemConfig) -> dict[str, str] | None:
    """One attempt at a problem; ``None`` when the story reaches a count no allowed step can change."""
    story = _Story(rng, config)
    n_steps = rng.randint(config.min_steps, config.max_steps)
    for _ in range(n_steps - _start(story)):
        choices = {op: _operands(op, story.x, config) for op in config.ops}
        feasible = [op for op in config.ops if choices[op]]
        if not feasible:
            return None
        op = rng.choice(feasible)
        story.apply(op, rng.choice(choices[op]), rng.choice(STEPS[op][: config.n_templates]))
    return story.record()


def make_problem(rng: random.Random, config: ProblemConfig = PRESETS["default"]) -> dict[str, str]:
    """Draw one problem from ``rng``; retries (drawing further from ``rng``) when a story dead-ends."""
    while True:
        problem = _try_problem(rng, config)
        if problem is not None:
            return problem


def _raw_stream(seed: int, config: ProblemConfig) -> Iterator[dict[str, str]]:
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, config)


def build_heldout() -> list[dict[str, str]]:
    """Regenerate the held-out set: the first ``HELDOUT_SIZE`` distinct problems at ``HELDOUT_SEED``."""
    seen: dict[str, dict[str, str]] = {}
    for problem in _raw_stream(HELDOUT_SEED, PRESETS["default"]):
        seen.setdefault(problem["question"], problem)
        if len(seen) == HELDOUT_SIZE:
            return list(seen.values())
    raise AssertionError("unreachable: the stream is infinite")


def heldout_set() -> list[dict[str, str]]:
    """The committed held-out test set (``synthetic_test.jsonl``), 500 records in file order."""
    text = resources.files("dllm.data").joinpath(HELDOUT_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


@lru_cache(maxsize=1)
def _heldout_questions() -> frozenset[str]:
    return frozenset(problem["question"] for problem in heldout_set())


def training_stream(seed: int, config: ProblemConfig = PRESETS["default"]) -> Iterator[dict[str, str]]:
    """Infinite, deterministic stream of training problems; never yields a held-out question."""
    excluded = _heldout_questions()
    return (problem for problem in _raw_stream(seed, config) if problem["question"] not in excluded)


def generate(n: int, seed: int, config: ProblemConfig = PRESETS["default"]) -> list[dict[str, str]]:
    """The first ``n`` problems of ``training_stream(seed, config)``."""
    return list(islice(training_stream(seed, config), n))


def write_heldout(path: str | Path | None = None) -> Path:
    """Rewrite the held-out file (default: the packaged one) from ``build_heldout()``; returns its path.

    This changes the benchmark whenever the generator has changed: do it on purpose, then update the
    file's hash in tests/test_data.py.
    """
    path = Path(path) if path is not None else Path(__file__).with_name(HELDOUT_FILE)
    write_jsonl(build_heldout(), path)
    return path


def write_jsonl(records: list[dict[str, str]], path: str | Path) -> None:
    """Write records one JSON object per line, as GSM8K's files are."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
