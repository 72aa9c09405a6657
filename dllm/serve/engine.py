"""The serving engine: one thread runs every decoding, each in a lane of its own, and batches their model calls.

A *lane* is one decoding (one choice of one request): ``dllm.generate`` at batch 1 on a ``LaneModel``, the model
as that lane sees it, whose forward calls go to the engine. Lanes are greenlets (``greenlet``: coroutines that
switch inside ordinary function calls) in the engine's one thread: a lane runs until it asks the model for
something, then the engine runs the next lane; once every lane is waiting (or has ended), the engine runs all their
calls as one batch (``forward_many`` where the model has it: one pass whose matmuls span every lane's tokens,
attention per lane; else one after the other) and resumes each lane with its answer. Hence:

- continuous batching: a new request's lane joins at the batch's next call, between the rounds of the others,
  and a lane that ends leaves at once (its place goes to the first queued lane);
- lanes share nothing but the model: each has its own sampler, options, temperature, stop list, cache and
  generator, so a seeded request gets what offline ``dllm.generate`` gives its prompt and seed, whatever else runs
  beside it (up to the rounding of matmuls over a different number of rows: ``docs/guides/serve.md``);
- a cancelled lane (its client went away, or the server is stopping) gets ``Cancelled`` raised at its next model
  call, and its place is free.

Why lanes and not one shared canvas: the samplers decode block-synchronously over a batch fixed at the start;
lanes run them unchanged, so every sampler is served (exact or not, diffusion or causal, with any options) and
what the server samples is by construction what ``generate`` samples. Why greenlets and not threads: every torch
operation then runs in one thread. Lane threads cost twice over on a CPU: the interpreter lock serialises their
Python anyway, and a second thread holding an OpenMP team made every forward 2x slower here (libgomp throttles
its spinning once more threads than cores exist: 16 prompts of fef took 2.10 s instead of 1.02 s on a 2-core CPU).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import greenlet
import torch

from dllm.defaults import SERVE_GRACE_S, SERVE_MAX_BATCH_SIZE, SERVE_MAX_QUEUE


class Cancelled(Exception):
    """The lane was cancelled (its client went away, or the server is stopping)."""


class QueueFull(Exception):
    """Every lane is busy and the queue is at its bound: try again later."""


class NotAccepting(Exception):
    """The engine is stopping and takes no new lanes."""


@dataclass(eq=False)
class _Call:
    lane: Lane
    name: str
    args: tuple
    kwargs: dict
    result: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class Lane:
    """One decoding: ``work(model)`` runs in the lane; ``on_done(result, error)`` is told how it ended (``error`` a
    ``Cancelled`` if it was cancelled before or while it ran), from the engine's thread."""

    work: Callable[[LaneModel], Any]
    on_done: Callable[[Any, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    _greenlet: greenlet.greenlet | None = field(default=None, repr=False)

    def cancel(self) -> None:
        self.cancelled.set()


class LaneModel:
    """The model as a lane sees it: ``forward`` / ``forward_cached`` (and calling it) go through the engine, every
    other attribute is the model's own (``capabilities``, ``new_cache``, ``tokenizer``, ...)."""

    def __init__(self, lane: Lane, model):
        self._lane, self._model = lane, model

    def __getattr__(self, name: str):  # only for what the class does not define
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return _ask(self._lane, "forward", args, kwargs)

    def forward(self, *args, **kwargs):
        return _ask(self._lane, "forward", args, kwargs)

    def forward_cached(self, *args, **kwargs):
        return _ask(self._lane, "forward_cached", args, kwargs)


def _ask(lane: Lane, name: str, args: tuple, kwargs: dict):
    """A lane's model call: hand it to the engine (the lane's parent greenlet) and wait for its answer."""
    if lane.cancelled.is_set():
        raise Cancelled()
    return greenlet.getcurrent().parent.switch(_Call(lane, name, args, kwargs))


@dataclass
class EngineCounts:
    """What the engine has done so far (read by the server's metrics)."""

    batches: int = 0  # engine steps (one batch of calls each)
    calls: int = 0  # lane calls answered
    lanes_done: int = 0


class Engine:
    """Lanes over one model; ``max_batch_size`` lanes run at once, ``max_queue`` more wait (``QueueFull`` past it).
    ``submit`` and ``stop`` are called from any thread; everything else happens in the engine's thread."""

    def __init__(self, model, max_batch_size: int = SERVE_MAX_BATCH_SIZE, max_queue: int = SERVE_MAX_QUEUE,
                 thread: bool = True):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.model, self.max_batch_size, self.max_queue = model, max_batch_size, max_queue
        self.counts = EngineCounts()
        self._many = getattr(model, "forward_many", None)
        self._cond = threading.Condition()
        self._new: list[Lane] = []  # submitted, not yet seen by the engine
        self._active: list[Lane] = []  # admitted: running or waiting on a call (engine thread only)
        self._queue: deque[Lane] = deque()
        self._waiting: list[_Call] = []  # calls asked since the last batch (engine thread only)
        self._accepting, self._stop = True, False
        # With ``thread`` False the caller runs the loop (``run``) in a thread of its choosing: best the thread that
        # loaded the model, so that one thread does every torch operation (see the module docstring).
        self._thread = threading.Thread(target=self.run, name="dllm-engine", daemon=True) if thread else None
        self._finished = threading.Event()
        if self._thread is not None:
            self._thread.start()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._queue) + len(self._new)

    def submit(self, lanes: list[Lane]) -> None:
        """Queue the lanes (they start as places free up); all or none (``QueueFull``, ``NotAccepting``)."""
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is stopping")
            waiting = len(self._queue) + len(self._new)
            free = self.max_batch_size - len(self._active)
            if waiting + len(lanes) - max(free, 0) > self.max_queue:
                raise QueueFull(f"{len(self._active)} lanes running and {waiting} queued "
                                f"(max_batch_size {self.max_batch_size}, max_queue {self.max_queue})")
            self._new.extend(lanes)
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------- the loop

    def run(self) -> None:
        """The engine's loop, until ``stop``; its own thread runs it unless made with ``thread=False``."""
        try:
            self._loop()
        except BaseException as error:  # a fault of the engine itself: every lane ends with it, none hangs
            with self._cond:
                self._accepting = False
                lanes = self._active + list(self._queue) + self._new
                self._active, self._new = [], []
                self._queue.clear()
            for lane in lanes:
                lane.on_done(None, RuntimeError(f"the serving engine failed: {type(error).__name__}: {error}"))
            raise
        finally:
            self._finished.set()

    def _loop(self) -> None:
        with torch.inference_mode():  # once for every lane: dllm generate decodes so, and lanes switch inside it
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._new or self._active or self._queue or self._stop)
                    self._queue.extend(self._new)
                    self._new.clear()
                    if self._stop and not self._active and not self._queue:
                        return
                calls = []
                while self._queue and len(self._active) < self.max_batch_size:  # new lanes run to their first call
                    lane = self._queue.popleft()
                    self._active.append(lane)
                    if lane.cancelled.is_set():
                        self._end(lane, None, Cancelled())
                        continue
                    lane._greenlet = greenlet.greenlet(lane.work)
                    self._resume(lane, calls, lambda g, lane=lane: g.switch(LaneModel(lane, self.model)))
                calls, self._waiting = self._waiting + calls, []
                if not calls:
                    continue
                self._execute(calls)
                self.counts.batches += 1
                self.counts.calls += len(calls)
                for call in calls:  # each lane runs on to its next call (or its end)
                    lane = call.lane
                    if call.error is not None:
                        self._resume(lane, self._waiting, lambda g, e=call.error: g.throw(e))
                    else:
                        self._resume(lane, self._waiting, lambda g, r=call.result: g.switch(r))
                del calls, call  # a waiting engine holds no lane's tensors

    def _resume(self, lane: Lane, calls: list, step) -> None:
        """Run ``lane`` (``step(its greenlet)``) until it asks for a call (added to ``calls``) or ends."""
        if lane.cancelled.is_set() and lane._greenlet:  # started and not ended: waiting on its call
            step = lambda g: g.throw(Cancelled())  # noqa: E731 - raised where the lane waits on its call
        try:
            asked = step(lane._greenlet)
        except BaseException as error:  # the lane's work raised: the request answers with it
            self._end(lane, None, error)
            return
        if lane._greenlet.dead:
            self._end(lane, asked, None)
        else:
            calls.append(asked)

    def _end(self, lane: Lane, result, error) -> None:
        self._active.remove(lane)
        self.counts.lanes_done += 1
        try:
            lane.on_done(result, error)
        except Exception:  # noqa: BLE001 - a listener's failure must not stop the engine
            pass

    def _execute(self, calls: list[_Call]) -> None:
        """Answer every call: cancelled lanes get ``Cancelled``, forward calls run as one ``forward_many`` pass
        where the model has it, the rest (and every call again, should the joint pass fail) one by one."""
        live = []
        for call in calls:
            if call.lane.cancelled.is_set():
                call.error = Cancelled()
            else:
                live.append(call)
        if self._many is not None and len(live) > 1:
            try:
                for call, out in zip(live, self._many([(c.name, c.args, c.kwargs) for c in live]), strict=True):
                    call.result = out
                return
            except Exception:  # noqa: BLE001 - each call alone below, so only a failing lane sees its error
                pass
        for call in live:
            try:
                method = self.model if call.name == "forward" else getattr(self.model, call.name)
                call.result = method(*call.args, **call.kwargs)
            except Exception as error:  # noqa: BLE001 - the lane raises it
                call.error = error

    # ------------------------------------------------------------------------------------------- stopping

    def stop(self, grace: float = SERVE_GRACE_S) -> None:
        """Take no new lanes; let the admitted ones finish for up to ``grace`` seconds, then cancel what is left
        (queued lanes are cancelled at once) and end the engine thread."""
        with self._cond:
            self._accepting = False
            for lane in self._new:
                lane.cancel()
            self._cond.notify_all()
        self._cancel_queued()
        deadline_thread = threading.Timer(grace, self._cancel_all)
        deadline_thread.daemon = True
        deadline_thread.start()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._finished.wait(timeout=grace + 30)
        deadline_thread.cancel()

    def _cancel_queued(self) -> None:
        for lane in list(self._queue):
            lane.cancel()

    def _cancel_all(self) -> None:
        for lane in list(self._active) + list(self._queue):
            lane.cancel()
