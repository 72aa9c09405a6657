"""``fef``: exact speculative denoising (drafts verified against the sequential chain, one call a round).

Where each part lives: ``config.py`` (``FefConfig``, its options and checks), ``round.py`` (``FefStepper``: the
round, copies or the structured verifier), ``sources.py`` (the draft sources: marginal, stale, head),
``trees.py`` (draft trees on the copies verifier), ``two_stream.py`` (the two-stream layout's cached chain and
one-call verifier, also ``sequential``'s there). The verification rule is shared: ``samplers/verify.py``.
Tests: ``tests/test_exactness.py``, ``tests/test_fef_trees.py``, ``tests/test_fef_head.py``,
``tests/test_two_stream.py``, ``tests/test_session.py``.
"""

import functools

from ..loop import Stepping, options_stepper, run
from .config import DRAFT_SOURCES, VERIFIERS, FefConfig
from .round import FefStepper
from .two_stream import layout

fef = functools.partial(run, Stepping(options_stepper(FefStepper), layout))

__all__ = ["DRAFT_SOURCES", "VERIFIERS", "FefConfig", "FefStepper", "fef"]
