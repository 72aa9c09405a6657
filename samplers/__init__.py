"""Samplers (installed as dllm.samplers): one package per family, one shared verification core.

Families: ``fef/``, ``sequential/``, ``ar_spec/`` (``ar``, ``ar_spec``), ``baselines/`` (``llada``, ``dream``,
``fast_dllm``, ``eb``, ``llada2``, ``sdar``, ``native``). Shared: ``registry`` (the table of names), ``options``
(configs and their checks), ``canvas`` and ``sessions`` (the masked samplers' canvas and how the model is called),
``loop`` (their block loop), ``order``, ``drafting`` and ``verify``.
"""

if not __name__.startswith("dllm."):  # imported by its bare name from the repository root: not ours to answer
    from dllm._root_folders import hand_over

    hand_over(__name__, __file__)
else:
    from .registry import SAMPLERS, SamplerSpec, parse_options, typed_options
    from .sequential import sequential_distribution
    from .verify import VerifyResult, verify

__all__ = ["SAMPLERS", "SamplerSpec", "VerifyResult", "parse_options", "sequential_distribution", "typed_options",
           "verify"]
