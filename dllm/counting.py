"""Counting model calls, one way for everyone: every call becomes one ``Call`` handed to a recorder
(``DecodeStats.record`` for the samplers' statistics, bench's ``CallLog.record`` for its cost model).

- The samplers' sessions and ``Caller`` (``samplers/sessions/``, ``samplers/calling.py``) record a ``Call`` for each
  model call they make themselves, so no wrapper stands between a sampler and the model.
- ``CountingModel`` wraps a model (plain, cached and structured calls) for a caller outside the samplers:
  bench counts through it.
- ``count_calls`` hooks a module: native loops (a checkpoint's own ``generate``) are counted that way.
- ``ModelClock`` (given to ``CountingModel``) adds up the wall time inside the calls, target and drafter apart:
  bench's clocked pass divides it by the pass's time for a round's non-model share.
  Adapters build a ``NativeLoop`` (their loop plus the modules it calls); ``samplers/baselines/native.py`` runs it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dllm.numerics import synchronize
from dllm.stats import DecodeStats

ROUND_RULES = ("steps", "tokens", "calls")


@dataclass(frozen=True)
class Call:
    """One model call as every recorder sees it."""

    rows: int  # inputs in the call (verification copies included)
    tokens: int  # token positions per input (a structured call: ``structured_tokens``)
    context: int = 0  # cached keys the call reads
    draft: bool = False  # a call of the drafter, not the target
    served: int | None = None  # sequences served (copies of one row count once); None: ``rows``


def structured_tokens(length: int, width: int) -> int:
    """Tokens of one ``structured_verify`` input: the state, W drafts, W position queries and the bonus."""
    return length + 2 * width + 1


class ModelClock:
    """Wall time spent inside model calls, the target's and the drafter's apart (``seconds[draft]``).

    The device is synchronised before and after each call, so queued work lands in the call that queued it (on
    a GPU this slows the pass it clocks: bench clocks a pass of its own, never a timed one). A call made while
    another is being clocked (a wrapper around a wrapper) counts once."""

    def __init__(self):
        self.seconds = {False: 0.0, True: 0.0}
        self._inside = False

    def __call__(self, draft: bool, device, method, *args, **kwargs):
        if self._inside:
            return method(*args, **kwargs)
        synchronize(device)
        start, self._inside = time.perf_counter(), True
        try:
            out = method(*args, **kwargs)
            synchronize(device)
        finally:
            self._inside = False
            self.seconds[draft] += time.perf_counter() - start
        return out


class CountingModel:
    """``model`` with every call reported to ``record(Call)``; answers and capabilities unchanged.

    Capabilities are forwarded only when the model has them, so whatever is discovered on the wrapper is
    what the model declares. ``served=`` (a sampler's count of sequences a call serves) is taken off the
    keyword arguments before the model sees them. ``clock`` (a ``ModelClock``): each call is timed too.
    """

    def __init__(self, model, record: Callable[[Call], None], draft: bool = False, clock: ModelClock | None = None):
        object.__setattr__(self, "_parts", (model, record, draft))
        object.__setattr__(self, "_clock", clock)
        self.__wrapped__ = model  # messages name the model, not this wrapper (inspect.unwrap)

    def _run(self, method, ids, *args, **kwargs):
        """``method(ids, *args, **kwargs)``, through the clock when there is one."""
        if self._clock is None:
            return method(ids, *args, **kwargs)
        return self._clock(self._parts[2], ids.device, method, ids, *args, **kwargs)

    def __call__(self, input_ids, *args, served: int | None = None, **kwargs):
        model, record, draft = self._parts
        record(Call(input_ids.shape[0], input_ids.shape[1], 0, draft, served))
        return self._run(model, input_ids, *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_parts", "_clock"):
            raise AttributeError(name)
        attr = getattr(self._parts[0], name)
        if name == "forward_cached":
            return functools.partial(self._cached, attr)
        if name == "structured_verify":
            return functools.partial(self._structured, attr)
        if name == "streams":
            return functools.partial(self._streams, attr)
        return attr

    def _streams(self, method, content_ids, content_pos, content_valid, query_pos, *args, cache=None, **kwargs):
        """A two-stream call (dllm/models/two_stream.py): content plus query tokens per input."""
        tokens = content_ids.shape[1] + query_pos.shape[1]
        self._parts[1](Call(content_ids.shape[0], tokens, cache.length if cache is not None else 0, self._parts[2]))
        return self._run(method, content_ids, content_pos, content_valid, query_pos, *args, cache=cache, **kwargs)

    def _cached(self, method, input_ids, cache, *args, served: int | None = None, **kwargs):
        _, record, draft = self._parts
        record(Call(input_ids.shape[0], input_ids.shape[1], cache.length, draft, served))
        return self._run(method, input_ids, cache, *args, **kwargs)

    def _structured(self, method, input_ids, positions, *args, cache=None, **kwargs):
        tokens = structured_tokens(input_ids.shape[1], positions.shape[1])
        self._parts[1](Call(input_ids.shape[0], tokens, cache.length if cache is not None else 0, self._parts[2]))
        return self._run(method, input_ids, positions, *args, cache=cache, **kwargs)


@dataclass(frozen=True)
class Counted:
    """A module whose forward calls are model calls: ``draft`` ones count as the drafter's; the ids are the
    keyword ``key`` (or the first positional argument); ``steps``: its calls are the loop's steps."""

    module: torch.nn.Module
    draft: bool = False
    key: str = "input_ids"
    steps: bool = False


@dataclass(frozen=True)
class NativeLoop:
    """A checkpoint's own generation loop, ready to run, and what the harness needs to count it.

    ``rounds`` says what a round is (``DecodeStats.rounds``): ``steps``, one step of one row (rows x step
    calls, for denoising loops); ``tokens``, one row's call while it runs (answer tokens per row, for plain
    AR loops); ``calls``, one step call (assisted generation, one row).
    """

    run: Callable[[], torch.Tensor]  # -> sequences [B, P + N'] (or an output with ``.sequences``)
    counted: list[Counted] = field(default_factory=list)
    rounds: str = "steps"
    pad_token_id: int = 0
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        if self.rounds not in ROUND_RULES:
            raise ValueError(f"NativeLoop rounds must be one of {ROUND_RULES}, got {self.rounds!r}")


def count_calls(module, stats: DecodeStats, draft: bool = False, key: str = "input_ids",
                calls: list | None = None):
    """A forward pre-hook on ``module`` counting each call in ``stats`` (the ids under ``key``, or the first
    positional argument, as checkpoints' own loops pass them), also appended to ``calls`` -> the handle."""
    def hook(module, args, kwargs):
        ids = kwargs.get(key, args[0] if args else None)
        stats.record(Call(ids.shape[0], ids.shape[1], 0, draft))
        if calls is not None:
            calls.append(1)

    return module.register_forward_pre_hook(hook, with_kwargs=True)
