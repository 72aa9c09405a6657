"""``ar`` and ``ar_spec``: autoregressive decoding of a causal target, plain and speculative.

``config.py`` holds their options (``ArConfig``, ``ArSpecConfig``), ``decode.py`` the two loops, ``drafters.py``
the ``Drafter`` protocol with the n-gram, causal-LM and diffusion drafters, ``heads.py`` the trained-head ones
(EAGLE, DFlash, repair). The verification rule is fef's (``samplers/verify.py``).
Tests: ``tests/test_drafters.py``, ``tests/test_draft_tree.py``, ``tests/test_ar_heads.py``,
``tests/test_exactness.py``.
"""

from .config import ArConfig, ArSpecConfig
from .decode import ar, ar_spec
from .drafters import Draft, DraftContext, Drafter

__all__ = ["ArConfig", "ArSpecConfig", "Draft", "DraftContext", "Drafter", "ar", "ar_spec"]
