"""OpenAI request bodies -> validated decoding jobs, before anything reaches the engine.

Every check raises ``BadRequest`` with one line naming the field and what is allowed (the server answers 400; a
``model`` the server does not serve: 404, ``UnknownModel``, as OpenAI answers it). An absent ``model`` is the first
served name (OpenAI requires the field; vLLM is as lenient).
The body is read as a plain JSON object rather than a pydantic model: dllm's sampler options sit beside OpenAI's
fields (``{"prompt": ..., "sampler": "fef", "window": 8}``), so the allowed names depend on the sampler, and the
messages follow the rest of dllm's (one line, the field, what is allowed).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from dllm.defaults import LOGPROBS_MODE, LOGPROBS_MODES, MAX_NEW_TOKENS, SERVE_MAX_N, SERVE_TEMPERATURE
from dllm.models.chat import missing_chat_template
from dllm.numerics import SEED_LIMIT
from dllm.protocols import context_length, is_causal_model, max_prompt_length
from dllm.samplers import SAMPLERS
from dllm.samplers.registry import typed_options

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_LOGPROBS = 20  # top alternatives a token may carry: OpenAI's chat limit (its completions allow 5)
# OpenAI fields dllm does not implement: refused when set to anything but their neutral value.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "frequency_penalty": (None, 0),
               "presence_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "repetition_penalty": (None, 1)}
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")  # read, not acted on
# Options a request may not set (``--option`` sets them at start): files or objects the server loads, and fef's
# call_tokens, the bound on one forward's activations that the operator sizes to the device's memory.
SERVER_ONLY = ("drafter", "draft_head", "callback", "call_tokens")


class BadRequest(ValueError):
    """A request the server refuses with ``status`` (400); the message names the field."""

    status, code, param = 400, None, None


class UnknownModel(BadRequest):
    """A ``model`` this server does not serve: 404 with OpenAI's error code."""

    status, code, param = 404, "model_not_found", "model"


@dataclass
class ServerSettings:
    """What the server was started with: the model, the names it answers to and its defaults."""

    model: Any
    model_names: tuple[str, ...]  # --served-model-name: what /v1/models lists and a request's model may be
    sampler: str
    options: dict = field(default_factory=dict)  # --option defaults (typed), for the server's sampler
    default_max_tokens: int = MAX_NEW_TOKENS
    default_temperature: float = SERVE_TEMPERATURE
    max_n: int = SERVE_MAX_N
    chat_template: str | None = None  # a Jinja template; None: the tokenizer's own
    logprobs_mode: str = LOGPROBS_MODE  # the distribution logprobs report when a request names none

    @property
    def model_name(self) -> str:
        """The first served name: what a request without ``model`` gets, and /health shows."""
        return self.model_names[0]


@dataclass
class Job:
    """One request, validated: what every lane of it decodes."""

    endpoint: str  # "completions" or "chat.completions"
    model_name: str  # the served name asked for (the first one when the request names none): responses carry it
    prompts: list[list[int]]  # token ids of each prompt (chat: one)
    max_tokens: int
    temperature: float
    sampler: str
    options: dict
    stop: list[str]
    stop_ids: tuple[int, ...] | None
    seed: int
    n: int
    stream: bool
    include_usage: bool
    stream_canvas: bool
    seed_given: bool
    exact: bool  # the sampler's config with these options samples the exact law (what generate reports)
    logprobs: int | None = None  # alternatives per token when the request asks for logprobs (None: not asked)
    echo: bool = False  # completions: the prompt's tokens, with their logprobs when asked, before the completion
    logprobs_mode: str = LOGPROBS_MODE

    def choices(self) -> list[tuple[int, list[int], int]]:
        """(choice index, prompt ids, seed) of every lane: prompt i's choice j is index i * n + j, seeded seed + j
        (each choice is the offline run of its prompt and seed)."""
        return [(i * self.n + j, ids, (self.seed + j) % SEED_LIMIT) for i, ids in enumerate(self.prompts)
                for j in range(self.n)]


def parse(body: Any, endpoint: str, settings: ServerSettings) -> Job:
    """A request body -> its Job; ``BadRequest`` on the first problem found."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model_name = _model_name(body.get("model"), settings)
    model, tokenizer = settings.model, settings.model.tokenizer
    sampler = _sampler(body.get("sampler", settings.sampler), model)
    prompts = _chat(body, tokenizer, settings) if endpoint == "chat.completions" else _prompts(body, tokenizer, model)
    known = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
             "stop", "stop_token_ids", "seed", "n", "stream", "stream_options", "sampler", "stream_canvas", "logprobs",
             "top_logprobs", "echo", "logprobs_mode", *IGNORED, *UNSUPPORTED}
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise BadRequest(f"{name} is not supported by dllm serve (got {body[name]!r}); leave it out")
    spec = SAMPLERS[sampler]
    extra = {key: value for key, value in body.items() if key not in known}
    refused = sorted(set(extra) & set(SERVER_ONLY))
    if refused:
        raise BadRequest(f"{refused[0]} can only be set when the server starts (dllm serve --option "
                         f"{refused[0]}=...), not per request")
    unknown = sorted(set(extra) - set(spec.options))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: not an OpenAI field dllm serve reads, nor an option of "
                         f"sampler {sampler!r} (its options: {sorted(set(spec.options) - set(SERVER_ONLY))})")
    options = dict(settings.options) if sampler == settings.sampler else {}
    options.update(_filters(body, spec, sampler))
    try:
        options.update(typed_options(sampler, extra))
    except ValueError as error:
        raise BadRequest(str(error)) from None

    logprobs, echo, mode = _logprobs(body, endpoint, settings)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    # max_tokens 0 with echo: the prompt scored, nothing generated (lm-eval's loglikelihood requests, vLLM's rule)
    max_tokens = settings.default_max_tokens if max_tokens is None else _int(name, max_tokens, 0 if echo else 1)
    for ids in prompts:
        _check_length(ids, max(max_tokens, 1), name, model)
    try:
        exact = spec.configure(options, model=model, max_new_tokens=max(max_tokens, 1)).exact
    except (ValueError, TypeError) as error:
        raise BadRequest(str(error)) from None
    if logprobs is not None and sampler == "native":
        raise BadRequest("logprobs: sampler 'native' runs the checkpoint's own loop, which hands back no logits; "
                         "name another sampler")

    temperature = body.get("temperature")
    temperature = settings.default_temperature if temperature is None else _number("temperature", temperature, 0.0)
    n = 1 if body.get("n") is None else _int("n", body["n"], 1, settings.max_n)
    seed = body.get("seed")
    seed_given = seed is not None
    seed = secrets.randbits(63) if seed is None else _int("seed", seed, 0, SEED_LIMIT - 1)
    stream = _bool("stream", body.get("stream", False))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise BadRequest("stream_options must be an object with at most include_usage (true or false)")
    if stream_options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    return Job(endpoint, model_name, prompts, max_tokens, float(temperature), sampler, options,
               _stop(body.get("stop")), _stop_ids(body.get("stop_token_ids"), model), seed, n, stream,
               _bool("stream_options.include_usage", stream_options.get("include_usage", False)),
               _bool("stream_canvas", body.get("stream_canvas", False)), seed_given, exact, logprobs, echo, mode)


# ------------------------------------------------------------------------------------------------ fields


def _logprobs(body: dict, endpoint: str, settings: ServerSettings) -> tuple[int | None, bool, str]:
    """(alternatives per token or None, echo, the distribution reported) in OpenAI's spelling of each endpoint:
    completions' ``logprobs`` is the number of alternatives (0: the token's alone) and ``echo`` prepends the prompt;
    chat's ``logprobs`` is true or false with ``top_logprobs`` the alternatives. ``logprobs_mode`` is dllm's."""
    mode = body.get("logprobs_mode", settings.logprobs_mode)
    if mode not in LOGPROBS_MODES:
        raise BadRequest(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {_shown(mode)}")
    value = body.get("logprobs")
    if endpoint == "completions":
        if "top_logprobs" in body:
            raise BadRequest("top_logprobs belongs to /v1/chat/completions; /v1/completions takes logprobs=K (the "
                             "alternatives per token)")
        echo = _bool("echo", body.get("echo", False))
        return (None if value is None else _int("logprobs", value, 0, MAX_LOGPROBS)), echo, mode
    if "echo" in body:
        raise BadRequest("echo belongs to /v1/completions; /v1/chat/completions has no echo")
    wanted = _bool("logprobs", False if value is None else value)
    top = body.get("top_logprobs")
    if top is not None:
        top = _int("top_logprobs", top, 0, MAX_LOGPROBS)
        if not wanted:
            raise BadRequest("top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None, False, mode


def _model_name(name, settings: ServerSettings) -> str:
    if name is None:
        return settings.model_name
    if not isinstance(name, str):
        raise BadRequest(f"model must be a string, got {_shown(name)}")
    if name not in settings.model_names:
        raise UnknownModel(f"the model {name!r} does not exist on this server; it serves "
                           f"{', '.join(map(repr, settings.model_names))} (GET /v1/models)")
    return name


def _sampler(name, model) -> str:
    if not isinstance(name, str) or name not in SAMPLERS:
        raise BadRequest(f"sampler must be one of {sorted(SAMPLERS)}, got {name!r}")
    kind = SAMPLERS[name].model_kind
    causal = is_causal_model(model)
    if (kind == "causal" and not causal) or (kind == "diffusion" and causal):
        fits = sorted(s for s, spec in SAMPLERS.items() if spec.model_kind in ("any", "causal" if causal else
                                                                                 "diffusion"))
        raise BadRequest(f"sampler {name!r} needs a {kind} model; this server's model is "
                         f"{'causal' if causal else 'a diffusion model'} (samplers for it: {fits})")
    return name


def _prompts(body: dict, tokenizer, model) -> list[list[int]]:
    if "messages" in body:
        raise BadRequest("messages belongs to /v1/chat/completions; /v1/completions takes prompt")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(prompt, tokenizer)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_encode(p, tokenizer) for p in prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [_ids(prompt, model)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(_is_int(t) for t in p)
                                                   for p in prompt):
        return [_ids(p, model) for p in prompt]
    raise BadRequest("prompt must be a string, a non-empty list of strings, a list of token ids or a list of "
                     f"lists of token ids; got {_shown(prompt)}")


def _chat(body: dict, tokenizer, settings: ServerSettings) -> list[list[int]]:
    if "prompt" in body:
        raise BadRequest("prompt belongs to /v1/completions; /v1/chat/completions takes messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages must be a non-empty list of {{role, content}} objects, got {_shown(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest(f"messages[{i}].role must be one of system, developer, user, assistant; got "
                             f"{_shown(message.get('role') if isinstance(message, dict) else message)}")
        if not isinstance(message.get("content"), str):
            raise BadRequest(f"messages[{i}].content must be a string (dllm serve takes text only), got "
                             f"{_shown(message.get('content'))}")
    template = settings.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequest(missing_chat_template(tokenizer, "start the server with --chat-template FILE, or send "
                                               "the prompt as text to /v1/completions"))
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return [tokenizer(text, add_special_tokens=False)["input_ids"]]


def _encode(text: str, tokenizer) -> list[int]:
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise BadRequest("prompt must not be empty (it encodes to no tokens)")
    return ids


def _ids(ids: list, model) -> list[int]:
    vocab, mask = model.vocab_size, getattr(model, "mask_token_id", None)
    for token in ids:
        if not 0 <= token < vocab or token == mask:
            raise BadRequest(f"prompt token ids must lie in [0, {vocab}) and not be the mask token ({mask}); "
                             f"got {token}")
    return list(ids)


def _check_length(ids: list[int], max_tokens: int, name: str, model) -> None:
    room = max_prompt_length(model, max_tokens)
    if room is not None and len(ids) > room:
        limit = context_length(model)
        if len(ids) >= limit:
            raise BadRequest(f"prompt is {len(ids)} tokens, the model's context is {limit}: shorten the prompt")
        raise BadRequest(f"{name} {max_tokens} + the prompt's {len(ids)} tokens exceed the model's context of "
                         f"{limit}: {name} <= {max_tokens - len(ids) + room} fits this prompt")


def _filters(body: dict, spec, sampler: str) -> dict:
    """top_p / top_k as the sampler's own options, where it has them; elsewhere only their neutral values."""
    out = {}
    for name, neutral in (("top_p", 1), ("top_k", None)):
        value = body.get(name)
        if value is None or (value == neutral and name not in spec.options):
            continue
        if name not in spec.options:
            raise BadRequest(f"{name} is not an option of sampler {sampler!r} (exact samplers sample the model's "
                             f"own law; samplers with {name}: "
                             f"{sorted(s for s, other in SAMPLERS.items() if name in other.options)})")
        out[name] = value
    return out


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, "
                         f"got {_shown(stop)}")
    return stops


def _stop_ids(ids, model) -> tuple[int, ...] | None:
    """The model's stop ids plus the request's ``stop_token_ids``."""
    from dllm.stops import model_stop_ids

    own = model_stop_ids(model) or ()
    if ids is None:
        return own or None
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise BadRequest(f"stop_token_ids must be a list of token ids, got {_shown(ids)}")
    mask = getattr(model, "mask_token_id", None)
    for token in ids:
        if not 0 <= token < model.vocab_size or token == mask:
            raise BadRequest(f"stop_token_ids must lie in [0, {model.vocab_size}) and not be the mask token "
                             f"({mask}); got {token}")
    return tuple(dict.fromkeys([*own, *ids])) or None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be an integer {allowed}, got {_shown(value)}")
    return value


def _number(name: str, value, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise BadRequest(f"{name} must be a finite number >= {low:g}, got {_shown(value)}")
    return float(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {_shown(value)}")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
