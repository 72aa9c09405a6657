"""The base class of the shipped metric modules: evaluate's `MetricInfo` and docstring from class constants."""

from __future__ import annotations

import abc
import textwrap

import datasets
import evaluate


def article(key: str, title: str, author: str, journal: str, year: int) -> str:
    """A metric's ``CITATION``: one BibTeX @article entry, laid out as evaluate shows it."""
    fields = {"title": title, "author": author, "journal": journal, "year": year}
    body = ",\n".join(f"  {name}={{{value}}}" for name, value in fields.items())
    return f"\n@article{{{key},\n{body}\n}}\n"


class ShippedMetric(evaluate.Metric, metaclass=abc.ABCMeta):
    """A metric described by `DESCRIPTION`, `INPUTS` (the arguments), `CITATION` and `FEATURES` (column types).

    Abstract, so that `evaluate.load`, which takes the first concrete `Metric` subclass a script holds,
    skips this imported base and finds the script's own class.
    """

    DESCRIPTION: str
    INPUTS: str
    CITATION: str
    FEATURES: dict[str, datasets.Value | datasets.Sequence] = {
        "predictions": datasets.Value("string"), "references": datasets.Value("string")}  # one string each

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The texts sit indented in the class body; evaluate shows them as written at the margin.
        for name in ("DESCRIPTION", "INPUTS", "CITATION"):
            setattr(cls, name, textwrap.dedent(getattr(cls, name)))
        # What evaluate's `add_start_docstrings(DESCRIPTION, INPUTS)` decorator writes, so help() reads the same.
        cls.__doc__ = cls.DESCRIPTION + cls.INPUTS + "\n\n" + (cls.__doc__ or "")

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(description=self.DESCRIPTION, citation=self.CITATION,
                                   inputs_description=self.INPUTS, features=datasets.Features(self.FEATURES))

    @abc.abstractmethod
    def _compute(self, predictions, references, **kwargs) -> dict[str, float]:
        """The metric's values from the columns (evaluate passes them after type checks)."""
