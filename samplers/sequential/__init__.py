"""``sequential``: the exact prefix-conditioned sampler, one token per model call (fef's reference chain).

``config.py`` holds its options, ``stepper.py`` its step and ``sequential_distribution`` (the chain's law,
enumerated); on a two-stream model it runs the two-stream layout's chain (``samplers/fef/two_stream.py``).
Tests: ``tests/test_exactness.py``, ``tests/test_two_stream.py``.
"""

import functools

from ..loop import Stepping, options_stepper, run
from .config import SequentialConfig
from .stepper import SequentialStepper, sequential_distribution


def _two_stream(model, options):
    from ..fef.two_stream import layout  # the two-stream chain is fef's round with no window

    return layout(model, {**options, "window": 0})


sequential = functools.partial(run, Stepping(options_stepper(SequentialStepper), _two_stream))

__all__ = ["SequentialConfig", "SequentialStepper", "sequential", "sequential_distribution"]
