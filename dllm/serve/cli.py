"""``dllm serve``: the OpenAI-compatible server (``dllm.serve.app``) under uvicorn.

SIGTERM or SIGINT (Ctrl-C) stops taking requests, lets those in flight finish for ``--grace`` seconds, cancels the
rest and exits 0; with ``--replicas`` the same holds for the replicas, and no process of Ray's is left.
Every default of a flag is in ``dllm.defaults``.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from pathlib import Path

from dllm.defaults import (
    DTYPE,
    DTYPES,
    LOGPROBS_MODE,
    LOGPROBS_MODES,
    MAX_NEW_TOKENS,
    SERVE_GRACE_S,
    SERVE_MAX_BATCH_SIZE,
    SERVE_MAX_N,
    SERVE_MAX_QUEUE,
    SERVE_TEMPERATURE,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm serve", description="An OpenAI-compatible server (/v1/completions, "
                                "/v1/chat/completions, /v1/models, /health, /metrics) with continuous batching.")
    p.add_argument("--model", default="diffusion", help="a shipped model's name, a folder or a hub id (default: "
                   "the shipped diffusion model)")
    p.add_argument("--kind", default="auto", help="as dllm generate --kind")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the names a request's model may be, "
                   "listed by /v1/models; a request naming another gets 404 model_not_found, one naming none the "
                   "first (default: --model)")
    p.add_argument("--sampler", help="the default sampler (default: fef for a diffusion model, ar for a causal one); "
                   "a request may name another")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a default option of --sampler (repeatable); requests may override per request")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1, this machine "
                   "only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=SERVE_MAX_BATCH_SIZE,
                   help=f"lanes (choices) decoding at once (default {SERVE_MAX_BATCH_SIZE})")
    p.add_argument("--max-queue", type=int, default=SERVE_MAX_QUEUE, help="lanes waiting beyond those; past it "
                   f"requests get 429 (default {SERVE_MAX_QUEUE})")
    p.add_argument("--max-n", type=int, default=SERVE_MAX_N, help=f"the largest n a request may ask (default "
                   f"{SERVE_MAX_N})")
    p.add_argument("--default-max-tokens", type=int, default=MAX_NEW_TOKENS, help="max_tokens of a request that "
                   f"gives none (default {MAX_NEW_TOKENS})")
    p.add_argument("--default-temperature", type=float, default=SERVE_TEMPERATURE, help="temperature of a request "
                   f"that gives none (default {SERVE_TEMPERATURE:g}, OpenAI's; 0: greedy)")
    p.add_argument("--logprobs-mode", default=LOGPROBS_MODE, choices=LOGPROBS_MODES,
                   help="the distribution logprobs report when a request names none (a request's logprobs_mode wins): "
                        f"sampled, the law each token was drawn from, or raw, the model's at temperature 1 (default "
                        f"{LOGPROBS_MODE})")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for /v1/chat/completions (default: "
                   "the tokenizer's, which a model folder declares; the shipped models': their training format)")
    p.add_argument("--dtype", default=DTYPE, choices=DTYPES)
    p.add_argument("--device", default=None)
    p.add_argument("--grace", type=float, default=SERVE_GRACE_S, help="seconds requests in flight get to finish "
                   f"at SIGTERM or SIGINT (default {SERVE_GRACE_S:g})")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--replicas", type=int, help="run N replicas of this server behind Ray Serve's proxy on --host:"
                   "--port (the [replicas] extra; dllm.serve.replicas)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)")
    p.add_argument("--ray-address", help="join this Ray cluster (e.g. auto) instead of starting a local instance")
    return p


_REPLICA_FLAGS = ("--replicas", "--replica-cpus", "--ray-address", "--host", "--port")


def build(args: argparse.Namespace, engine_thread: bool = True):
    """The app for parsed arguments (loads the model); what ``main`` serves and tests start in-process. With
    ``engine_thread`` False the caller runs ``app.state.engine.run()`` (``main`` does, in the loading thread)."""
    from dllm.cli import UserError, _load
    from dllm.protocols import is_causal_model
    from dllm.samplers import SAMPLERS, parse_options

    from .app import create_app
    from .engine import Engine
    from .requests import BadRequest, ServerSettings, _sampler

    names, template = _checked(args)
    model = _load(args.model, "--model", args.kind, args.device, args.dtype)
    if getattr(model, "tokenizer", None) is None:
        raise UserError(f"--model {args.model}: the checkpoint has no tokenizer, and the server takes text")
    sampler = args.sampler or ("ar" if is_causal_model(model) else "fef")
    try:
        _sampler(sampler, model)
    except BadRequest as error:
        raise UserError(f"--{error}") from None
    options = parse_options(sampler, args.option)
    SAMPLERS[sampler].configure(options, model=model, max_new_tokens=args.default_max_tokens)
    settings = ServerSettings(model, names, sampler, options, args.default_max_tokens, args.default_temperature,
                              args.max_n, template, args.logprobs_mode)
    engine = Engine(model, max_batch_size=args.max_batch_size, max_queue=args.max_queue, thread=engine_thread)
    return create_app(settings, engine, grace=args.grace)


def _checked(args: argparse.Namespace) -> tuple[tuple[str, ...], str | None]:
    """The checks of the flags that need no model (made before Ray starts any replica): the served names and the
    chat template's text."""
    from dllm.cli import UserError, check_device
    from dllm.samplers import SAMPLERS

    for flag, value, low in (("--port", args.port, 0), ("--max-batch-size", args.max_batch_size, 1),
                             ("--max-queue", args.max_queue, 0), ("--max-n", args.max_n, 1),
                             ("--default-max-tokens", args.default_max_tokens, 1)):
        if value < low or (flag == "--port" and value > 65535):
            raise UserError(f"{flag} must be {'in [0, 65535]' if flag == '--port' else f'>= {low}'}, got {value}")
    for flag, value in (("--grace", args.grace), ("--default-temperature", args.default_temperature)):
        if not math.isfinite(value) or value < 0:
            raise UserError(f"{flag} must be a finite number >= 0, got {value}")
    names = args.served_model_name or [args.model]
    if not all(names) or len(set(names)) < len(names):
        raise UserError(f"--served-model-name must be distinct non-empty names, got {names}")
    if args.sampler is not None and args.sampler not in SAMPLERS:
        raise UserError(f"--sampler must be one of {sorted(SAMPLERS)}, got {args.sampler!r}")
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise UserError(f"--chat-template {args.chat_template}: no such file")
        template = path.read_text()
    check_device(args.device)
    return tuple(names), template


def main(argv: list[str] | None = None) -> int:
    from dllm.cli import run_guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    return run_guarded("serve", lambda: _serve(parser().parse_args(argv), argv))


def _serve(args: argparse.Namespace, argv: list[str]) -> int:
    from dllm.cli import UserError
    from dllm.extras import missing

    try:
        import uvicorn
    except ImportError:
        raise UserError(missing("uvicorn", "serve", "dllm serve")) from None
    if args.replicas is not None:
        return _replicas(args, argv)
    # The engine runs in this thread, which loaded the model, and uvicorn in another: every torch operation then
    # happens in one thread (dllm.serve.engine says why). Signals are taken here and passed to uvicorn, which
    # stops gracefully (its own handlers would re-raise the signal after, and the process would die of it).
    app = build(args, engine_thread=False)
    settings, engine = app.state.settings, app.state.engine
    print(f"dllm serve: {', '.join(settings.model_names)} ({type(settings.model).__name__}), sampler "
          f"{settings.sampler}, temperature {settings.default_temperature:g} and max_tokens "
          f"{settings.default_max_tokens} where a request sets none, on http://{args.host}:{args.port} (max batch "
          f"{args.max_batch_size}, queue {args.max_queue})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.grace))
    stopped_by = []

    def stop(signum, frame) -> None:
        stopped_by.append(signal.Signals(signum).name)
        server.handle_exit(signum, frame)

    def serve() -> None:
        try:
            server.run()
        finally:  # also when uvicorn could not start (a port in use): the engine's loop must end
            engine.stop(args.grace)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    http = threading.Thread(target=serve, name="dllm-http")
    http.start()
    engine.run()
    http.join()
    if stopped_by:
        print(f"dllm serve: stopped by {stopped_by[0]}", file=sys.stderr)
    return 0 if server.started else 1


def _replicas(args: argparse.Namespace, argv: list[str]) -> int:
    """``--replicas N``: the other flags go to every replica (dllm.serve.replicas)."""
    from dllm.cli import UserError

    if args.replicas < 1 or args.replica_cpus <= 0:
        raise UserError(f"--replicas must be >= 1 and --replica-cpus > 0, got {args.replicas} and "
                        f"{args.replica_cpus}")
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # (not imported: Ray reads its settings when imported, which
        from dllm.extras import missing  # dllm.serve.replicas sets first)

        raise UserError(missing("ray[serve]", "replicas", "--replicas (Ray Serve)"))
    _checked(args)  # a bad flag fails here in one line, not in every replica after Ray has started
    from .replicas import serve_forever

    return serve_forever(_without(argv, _REPLICA_FLAGS), args.replicas, args.host, args.port, args.replica_cpus,
                         args.ray_address, args.grace)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less ``flags`` and their values (``--flag value`` or ``--flag=value``)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif not item.startswith(tuple(flag + "=" for flag in flags)):
            kept.append(item)
    return kept


if __name__ == "__main__":
    sys.exit(main())
