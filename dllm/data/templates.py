"""Word lists and sentence templates for the synthetic arithmetic problems.

Kept as plain data so the story variety can be read (and changed) in one place. The vocabulary is
deliberately small: the models trained on this text have a few million parameters.

Placeholders in a template: ``{n}`` the current owner's name, ``{f}`` a second, fresh name, ``{he}``
the owner's pronoun, ``{b}`` the operand, ``{bx}`` the operand with its noun ("1 apple", "4 apples"),
``{obj}`` the plural noun, ``{box}``/``{boxes}`` a container, ``{calc}`` the worked step
("12+5=<<12+5=17>>17 apples"). Every step's expression is ``x op b`` with ``x`` the running count.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """One sentence of a story and the solution line that works it out.

    ``new_owner``: after this step the count belongs to ``{f}`` ("Sam has 3 more apples than Tom"),
    so later sentences and the final question are about ``{f}``.
    """

    question: str
    solution: str
    new_owner: bool = False


# (name, pronoun). Short, common names keep the tokenizer's vocabulary small.
NAMES: tuple[tuple[str, str], ...] = (
    ("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"), ("Lily", "she"),
    ("Max", "he"), ("Emma", "she"), ("Leo", "he"), ("Zoe", "she"), ("Jack", "he"), ("Kate", "she"),
)

# (singular, plural).
OBJECTS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("pen", "pens"), ("book", "books"), ("card", "cards"), ("ball", "balls"),
    ("cookie", "cookies"), ("marble", "marbles"), ("shell", "shells"), ("sticker", "stickers"),
    ("egg", "eggs"), ("toy", "toys"), ("stamp", "stamps"),
)

CONTAINERS: tuple[tuple[str, str], ...] = (
    ("bag", "bags"), ("box", "boxes"), ("jar", "jars"), ("basket", "baskets"), ("pack", "packs"),
)

# A story starts from a plain count (no solution line: nothing is computed) ...
PLAIN_STARTS: tuple[str, ...] = (
    "{n} has {bx}.",
    "There are {bx} in {n}'s bag.",
)

# ... or from groups, which is the step x*b with x the number of containers.
GROUP_STARTS: tuple[Template, ...] = (
    Template("{n} has {x} {boxes} with {bx} each.", "{n} has {calc}."),
    Template("{n} buys {x} {boxes} of {obj}. Each {box} has {bx}.", "{n} has {calc}."),
)

# Per operation, actions (same owner) alternate with comparisons (new owner), so that the first
# ``n_templates`` of a list always mix both kinds. The kind decides the solution line, written once here.
def _alternate(actions: tuple[str, ...], comparisons: tuple[str, ...]) -> tuple[Template, ...]:
    """Action, comparison, action, ...: the owner keeps the count after an action, ``{f}`` takes it after a
    comparison."""
    if not len(actions) - 1 <= len(comparisons) <= len(actions):
        raise ValueError(f"{len(actions)} actions cannot alternate with {len(comparisons)} comparisons")
    steps = []
    for i, action in enumerate(actions):
        steps.append(Template(action, "{n} now has {calc}."))
        if i < len(comparisons):
            steps.append(Template(comparisons[i], "{f} has {calc}.", new_owner=True))
    return tuple(steps)


STEPS: dict[str, tuple[Template, ...]] = {
    "+": _alternate(("{n} buys {b} more {obj}.", "{f} gives {n} {bx}.", "{n} finds {b} more {obj}."),
                    ("{f} has {bx} more than {n}.", "{n} has {bx} fewer than {f}.")),
    "-": _alternate(("{n} gives {bx} to {f}.", "{n} sells {bx}.", "{n} loses {bx}."),
                    ("{f} has {bx} fewer than {n}.", "{n} has {bx} more than {f}.")),
    "*": _alternate(("{n} ends up with {b} times as many {obj} as before.",
                     "{n} buys more {obj} until {he} has {b} times as many."),
                    ("{f} has {b} times as many {obj} as {n}.",)),
    "/": _alternate(("{n} splits them into {b} equal piles and keeps one.",
                     "{n} puts them into {b} {boxes} with the same number in each and keeps one {box}."),
                    ("{n} has {b} times as many {obj} as {f}.",)),
}

FINAL_QUESTION = "How many {obj} does {n} have?"
