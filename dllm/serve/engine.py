"""The serving engine: one thread owns the model's forward passes; each decoding runs in a lane of its own.

A *lane* is one decoding (one choice of one request): ``dllm.generate`` at batch 1 in a thread of its own, on a
``LaneModel``, the model as that lane sees it, whose forward calls go to the engine. The engine thread waits until
every lane that is running has asked for its next call (or ended), runs all those calls as one batch
(``forward_many`` where the model has it: one pass whose matmuls span every lane's tokens, attention per lane;
else one after the other), hands each lane its answer, and waits again. Hence:

- continuous batching: a new request's lane joins at the batch's next call, between the rounds of the others,
  and a lane that ends leaves at once (its place goes to the first queued lane);
- lanes share nothing but the model: each has its own sampler, options, temperature, stop list, cache and
  generator, so a seeded request gets what offline ``dllm.generate`` gives its prompt and seed, whatever else runs
  beside it (up to the rounding of matmuls over a different number of rows: ``docs/guides/serve.md``);
- a cancelled lane (its client went away, or the server is stopping) raises ``Cancelled`` at its next model call,
  and its place is free.

Why lanes and not one shared canvas: the samplers decode block-synchronously over a batch fixed at the start;
lanes run them unchanged, so every sampler is served (exact or not, diffusion or causal, with any options) and
what the server samples is by construction what ``generate`` samples.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

BATCHED = ("forward", "forward_cached")  # the calls the engine batches; every other method runs in the lane


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
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class Lane:
    """One decoding: ``work(model)`` runs in the lane's thread; ``on_done(result, error)`` is told how it ended
    (``error`` a ``Cancelled`` if it was cancelled before or while it ran)."""

    work: Callable[[LaneModel], Any]
    on_done: Callable[[Any, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class LaneModel:
    """The model as a lane sees it: ``forward`` / ``forward_cached`` (and calling it) go through the engine, every
    other attribute is the model's own (``capabilities``, ``new_cache``, ``tokenizer``, ...)."""

    def __init__(self, engine: Engine, lane: Lane):
        self._engine, self._lane = engine, lane

    def __getattr__(self, name: str):  # only for what the class does not define
        return getattr(self._engine.model, name)

    def __call__(self, *args, **kwargs):
        return self._engine.call(self._lane, "forward", args, kwargs)

    def forward(self, *args, **kwargs):
        return self._engine.call(self._lane, "forward", args, kwargs)

    def forward_cached(self, *args, **kwargs):
        return self._engine.call(self._lane, "forward_cached", args, kwargs)


@dataclass
class EngineCounts:
    """What the engine has done so far (read by the server's metrics)."""

    batches: int = 0  # engine steps (one batch of calls each)
    calls: int = 0  # lane calls answered
    lanes_done: int = 0


class Engine:
    """Lanes over one model; ``max_batch_size`` lanes run at once, ``max_queue`` more wait (``QueueFull`` past it)."""

    def __init__(self, model, max_batch_size: int = 16, max_queue: int = 64):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.model, self.max_batch_size, self.max_queue = model, max_batch_size, max_queue
        self.counts = EngineCounts()
        self._many = getattr(model, "forward_many", None)
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._running = 0  # active lanes executing their own code (not waiting on a call)
        self._active: set[Lane] = set()
        self._queue: deque[Lane] = deque()
        self._accepting, self._stop = True, False
        self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- lanes

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, lanes: list[Lane]) -> None:
        """Start the lanes, or queue those that find no free place; all or none (``QueueFull``, ``NotAccepting``)."""
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is stopping")
            free = self.max_batch_size - len(self._active)
            if len(lanes) - max(free, 0) > self.max_queue - len(self._queue):
                raise QueueFull(f"{len(self._active)} lanes running and {len(self._queue)} queued "
                                f"(max_batch_size {self.max_batch_size}, max_queue {self.max_queue})")
            for lane in lanes:
                if len(self._active) < self.max_batch_size:
                    self._start(lane)
                else:
                    self._queue.append(lane)

    def _start(self, lane: Lane) -> None:  # under the lock
        self._active.add(lane)
        self._running += 1
        threading.Thread(target=self._run_lane, args=(lane,), name="dllm-lane", daemon=True).start()

    def _run_lane(self, lane: Lane) -> None:
        result, error = None, None
        try:
            if lane.cancelled.is_set():
                raise Cancelled()
            with torch.inference_mode():  # as dllm generate runs; the engine's answers are inference tensors
                result = lane.work(LaneModel(self, lane))
        except BaseException as caught:  # the request answers with it; the engine goes on
            error = caught
        finally:
            with self._cond:
                self._active.discard(lane)
                self._running -= 1
                self.counts.lanes_done += 1
                self._admit()
                self._cond.notify_all()
        lane.on_done(result, error)

    def _admit(self) -> None:  # under the lock: queued lanes into free places (cancelled ones end at once)
        while self._queue and len(self._active) < self.max_batch_size:
            lane = self._queue.popleft()
            if lane.cancelled.is_set():
                threading.Thread(target=lane.on_done, args=(None, Cancelled()), daemon=True).start()
            else:
                self._start(lane)

    def call(self, lane: Lane, name: str, args: tuple, kwargs: dict):
        """A lane's model call: queued for the engine's next batch; returns its answer (raises ``Cancelled``)."""
        if lane.cancelled.is_set():
            raise Cancelled()
        call = _Call(lane, name, args, kwargs)
        with self._cond:
            self._pending.append(call)
            self._running -= 1
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    # ------------------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (self._pending and self._running == 0) or self._stop)
                if self._stop and not self._pending:
                    return
                calls, self._pending = self._pending, []
            self._execute(calls)
            with self._cond:  # counted running before any lane wakes: a fast lane cannot run a batch alone
                self._running += len(calls)
                self.counts.batches += 1
                self.counts.calls += len(calls)
            for call in calls:
                call.done.set()

    def _execute(self, calls: list[_Call]) -> None:
        """Answer every call: cancelled lanes get ``Cancelled``, forward calls run as one ``forward_many`` pass
        where the model has it, the rest (and every call again, should the joint pass fail) one by one."""
        live = []
        for call in calls:
            if call.lane.cancelled.is_set():
                call.error = Cancelled()
            else:
                live.append(call)
        with torch.inference_mode():
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

    def stop(self, grace: float = 10.0) -> None:
        """Take no new lanes; let the running ones finish for up to ``grace`` seconds, then cancel what is left
        (queued lanes are cancelled at once) and end the engine thread."""
        with self._cond:
            self._accepting = False
            while self._queue:
                lane = self._queue.popleft()
                lane.cancel()
                threading.Thread(target=lane.on_done, args=(None, Cancelled()), daemon=True).start()
            self._cond.wait_for(lambda: not self._active, timeout=grace)
            for lane in self._active:
                lane.cancel()
            self._cond.wait_for(lambda: not self._active, timeout=max(grace, 1.0))
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
