"""The HTTP side of ``dllm serve``: OpenAI's routes on FastAPI, over the lanes of ``dllm.serve.engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events with ``stream``),
``GET /v1/models`` (the served names, each with the server's defaults under ``dllm``), ``GET /health``,
``GET /metrics`` (Prometheus text). A request is validated whole (``dllm.serve.requests``: 400 naming the field, 404
for a model not served) before any lane starts; a full queue answers 429 with Retry-After; a lane that raises answers
500 and the others go on; a client that goes away cancels its lanes. Errors are OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dllm.defaults import SERVE_GRACE_S

from .choice import ChoiceRun, Outcome
from .engine import Cancelled, Engine, Lane, NotAccepting, QueueFull
from .metrics import Metrics
from .requests import BadRequest, Job, ServerSettings, parse

RETRY_AFTER_S = 1  # what a 429 asks the client to wait


def create_app(settings: ServerSettings, engine: Engine, grace: float = SERVE_GRACE_S) -> FastAPI:
    """The server's app over ``engine`` (running in a thread of its own or the caller's); the app's end stops the
    engine (``grace`` seconds for the lanes still running)."""
    metrics = Metrics()
    metrics.watch(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.stop, grace)

    app = FastAPI(title="dllm serve", lifespan=lifespan)
    app.state.settings, app.state.metrics, app.state.engine = settings, metrics, engine

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, "pid": os.getpid()}  # (replicas tell apart)

    @app.get("/v1/models")
    async def models():
        defaults = {"sampler": settings.sampler, "options": {k: v for k, v in settings.options.items() if _plain(v)},
                    "temperature": settings.default_temperature, "max_tokens": settings.default_max_tokens,
                    "max_n": settings.max_n}  # what a request that sets none of them gets
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dllm",
                                            "dllm": defaults} for name in settings.model_names]}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat.completions")

    async def _serve(request: Request, endpoint: str):
        started = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return _error(metrics, endpoint, 400, "the request body must be JSON")
        try:
            job = parse(body, endpoint, settings)
        except BadRequest as error:
            return _error(metrics, endpoint, error.status, str(error), param=error.param, code=error.code)
        call = _Request(job, settings, asyncio.get_running_loop())
        try:
            app.state.engine.submit(call.lanes)
        except QueueFull as error:
            return _error(metrics, endpoint, 429, f"the server is busy: {error}; retry later",
                          headers={"Retry-After": str(RETRY_AFTER_S)}, kind="rate_limit_exceeded")
        except NotAccepting as error:
            return _error(metrics, endpoint, 503, str(error), kind="server_error")
        if job.stream:
            return StreamingResponse(call.events(metrics, started), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await call.whole(request, metrics, started)

    return app


def _error(metrics: Metrics, endpoint: str, status: int, message: str, headers: dict | None = None,
           kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error object (``type``, ``param`` and ``code`` as OpenAI sets them, e.g. 404 ``model_not_found``)."""
    metrics.requests.labels(endpoint, str(status)).inc()
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class _Request:
    """One request's lanes and what they send back, bridged from their threads to the event loop."""

    def __init__(self, job: Job, settings: ServerSettings, loop: asyncio.AbstractEventLoop):
        self.job, self.loop = job, loop
        self.id = ("cmpl-" if job.endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        model = settings.model
        self.tokenizer = model.tokenizer
        self.runs = [ChoiceRun(job, index, ids, seed, model.tokenizer, getattr(model, "mask_token_id", None),
                               self._emit) for index, ids, seed in job.choices()]
        self.lanes = [Lane(run.work, self._done(run.index)) for run in self.runs]

    def _emit(self, kind: str, index: int, payload) -> None:  # from a lane's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, index, payload))

    def _done(self, index: int):
        def told(result, error) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (server stopped): nobody to tell
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", index, (result, error)))
        return told

    def cancel(self) -> None:
        for lane in self.lanes:
            lane.cancel()

    # ------------------------------------------------------------------------------------------ whole answers

    async def whole(self, request: Request, metrics: Metrics, started: float):
        outcomes: dict[int, Outcome] = {}
        watcher = asyncio.create_task(self._watch(request))
        try:
            while len(outcomes) < len(self.lanes):
                kind, index, payload = await self.queue.get()
                if kind != "done":
                    continue
                result, error = payload
                if isinstance(error, Cancelled):
                    metrics.requests.labels(self.job.endpoint, "499").inc()
                    return Response(status_code=499)  # nobody is listening; a status for the logs
                if error is not None:
                    self.cancel()
                    return _error(metrics, self.job.endpoint, 500, f"decoding failed: {type(error).__name__}: "
                                  f"{error}", kind="server_error")
                outcomes[index] = result
        finally:
            watcher.cancel()
            if len(outcomes) < len(self.lanes):  # also when this task is cancelled (the server's grace is over)
                self.cancel()
        metrics.finished(self.job, outcomes.values(), started, first_token=None)
        return JSONResponse(self._body(outcomes))

    async def _watch(self, request: Request) -> None:
        """Cancel the lanes when the client goes away."""
        while True:
            if await request.is_disconnected():
                self.cancel()
                return
            await asyncio.sleep(0.05)

    def _body(self, outcomes: dict[int, Outcome]) -> dict:
        job = self.job
        choices = []
        for index in sorted(outcomes):
            outcome = outcomes[index]
            if job.endpoint == "completions":
                prompt = self.runs[index].prompt
                choice = {"index": index, "text": self.runs[index].echoed + outcome.text,
                          "logprobs": self._completion_logprobs(outcome, prompt)}
            else:
                choice = {"index": index, "message": {"role": "assistant", "content": outcome.text},
                          "logprobs": self._chat_logprobs(outcome.logprobs)}
            choices.append({**choice, "finish_reason": outcome.finish_reason})
        return {"id": self.id, "object": "text_completion" if job.endpoint == "completions" else "chat.completion",
                "created": self.created, "model": self.job.model_name, "choices": choices,
                "usage": self._usage(outcomes.values()), "dllm": self._extension(outcomes)}

    # ------------------------------------------------------------------------------------------ logprobs

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _completion_logprobs(self, outcome: Outcome, prompt: list[int]) -> dict | None:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}) and text_offset
        (each token's first character in ``text``); with echo the prompt's tokens come first (the first one
        scored None, having no context)."""
        if self.job.logprobs is None:
            return None
        entries = [*(outcome.prompt_logprobs or [None] * len(prompt) if self.job.echo else []),
                   *(outcome.logprobs or [])]
        ids = [*(prompt if self.job.echo else []), *outcome.token_ids]
        return self._completion_fields(ids, entries, offset=0)

    def _completion_fields(self, ids: list[int], entries: list[dict | None], offset: int) -> dict:
        tokens, logprobs, tops, offsets = [], [], [], []
        for token, entry in zip(ids, entries):
            piece = self._decode([token])
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            logprobs.append(None if entry is None else _finite(entry["logprob"]))
            tops.append(None if entry is None else {self._decode([t]): _finite(v) for t, v in entry["top"]})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, entries: list[dict] | None) -> dict | None:
        """OpenAI's chat logprobs: ``content``, one {token, logprob, bytes, top_logprobs} per token."""
        if entries is None:
            return None
        content = []
        for entry in entries:
            piece = self._decode([entry["id"]])
            content.append({"token": piece, "logprob": _finite(entry["logprob"]), "bytes": list(piece.encode()),
                            "top_logprobs": [{"token": self._decode([t]), "logprob": _finite(v),
                                              "bytes": list(self._decode([t]).encode())} for t, v in entry["top"]]})
        return {"content": content, "refusal": None}

    def _usage(self, outcomes) -> dict:
        prompt = sum(len(ids) for ids in self.job.prompts)
        completion = sum(outcome.completion_tokens for outcome in outcomes)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _extension(self, outcomes: dict[int, Outcome]) -> dict:
        """dllm's statistics beside OpenAI's fields: sampler, options, exactness, and per choice its seed, token
        ids, model calls, tokens per call and acceptance."""
        job = self.job
        exact = all(outcome.exact for outcome in outcomes.values())
        logprobs = {} if job.logprobs is None else {"logprobs": {
            "mode": job.logprobs_mode,
            "law": ("the chain the exact sampler sampled: a choice's sum is its completion's log-probability"
                    if exact else "the marginals the approximate sampler committed from, not the sample's "
                                  "probability"),
            **({"prompt": "dllm.score at temperature 1: each prompt token given the ones before it"}
               if job.echo else {})}}
        return {"sampler": job.sampler, "options": {k: v for k, v in job.options.items() if _plain(v)},
                "temperature": job.temperature, "max_tokens": job.max_tokens, "seed": job.seed,
                "exact": exact, **logprobs,
                "choices": [{"index": index, "seed": outcomes[index].seed, "token_ids": outcomes[index].token_ids,
                             **outcomes[index].stats}
                            for index in sorted(outcomes)]}

    # ------------------------------------------------------------------------------------------ streams

    async def events(self, metrics: Metrics, started: float):
        """Server-sent events in OpenAI's chunk format; a client that goes away (the generator is closed)
        cancels the lanes."""
        job, outcomes, first, ended = self.job, {}, None, False
        try:
            if job.endpoint == "chat.completions":
                for index in range(len(self.lanes)):
                    yield self._chunk(index, {"role": "assistant", "content": ""})
            while len(outcomes) < len(self.lanes):
                kind, index, payload = await self.queue.get()
                if kind == "text":
                    first = first or time.monotonic()
                    text, entries, offset = payload
                    yield self._chunk(index, text, logprobs=entries, offset=offset)
                elif kind == "canvas":
                    yield _sse({"id": self.id, "object": "dllm.canvas", "created": self.created,
                                "model": self.job.model_name, "choices": [{"index": index, "canvas": payload}]})
                else:
                    result, error = payload
                    if error is not None:
                        self.cancel()
                        status = "499" if isinstance(error, Cancelled) else "500"
                        metrics.requests.labels(job.endpoint, status).inc()
                        ended = True
                        yield _sse({"error": {"message": f"decoding failed: {type(error).__name__}: {error}",
                                              "type": "server_error", "param": None, "code": None}})
                        return
                    outcomes[index] = result
                    yield self._chunk(index, None, result.finish_reason)
            final = {"id": self.id, "object": self._object(), "created": self.created,
                     "model": self.job.model_name, "choices": [], "dllm": self._extension(outcomes)}
            if job.include_usage:
                final["usage"] = self._usage(outcomes.values())
            yield _sse(final)
            yield "data: [DONE]\n\n"
            metrics.finished(job, outcomes.values(), started, first_token=first)
        finally:
            if len(outcomes) < len(self.lanes) and not ended:  # the client went away before the end
                self.cancel()
                metrics.requests.labels(job.endpoint, "499").inc()

    def _object(self) -> str:
        return "text_completion" if self.job.endpoint == "completions" else "chat.completion.chunk"

    def _chunk(self, index: int, text, finish_reason: str | None = None, logprobs: list | None = None,
               offset: int = 0) -> str:
        """One chunk of choice ``index``: new text, and with logprobs the entries of the tokens it completes (the first
        at character ``offset`` of the choice's whole text; a prompt's first entry is None, echo)."""
        if self.job.endpoint == "completions":
            fields = None
            if logprobs is not None:
                ids = self.runs[index].prompt if logprobs and logprobs[0] is None else [e["id"] for e in logprobs]
                fields = self._completion_fields(ids, logprobs, offset=offset)
            choice = {"index": index, "text": text or "", "logprobs": fields, "finish_reason": finish_reason}
        else:
            delta = text if isinstance(text, dict) else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(logprobs),
                      "finish_reason": finish_reason}
        return _sse({"id": self.id, "object": self._object(), "created": self.created,
                     "model": self.job.model_name, "choices": [choice]})


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _finite(value: float) -> float:
    """A log-probability JSON can carry: -inf (a token the law cannot produce) as OpenAI's -9999.0."""
    return value if value != float("-inf") else -9999.0


def _plain(value) -> bool:
    return value is None or isinstance(value, bool | int | float | str)
