"""``dllm serve --replicas N``: the same app in N replicas behind Ray Serve's HTTP proxy (``pip install
"ray[serve]"``), on one machine or across a Ray cluster.

Each replica is a Ray actor that loads the model once and runs ``dllm.serve.app`` with its own engine (the app is
built on the replica by ``serve.ingress``'s builder); Ray Serve's proxy spreads requests over the replicas and
passes streams through. Nothing here balances load or restarts replicas by hand: Ray does.

One machine: ``dllm serve --replicas 2`` starts a private Ray instance (``address="local"``). Several: start a
cluster (``ray start --head`` on one machine, ``ray start --address HEAD:6379`` on the others) and pass
``--ray-address auto`` on the head; replicas then land wherever Ray has CPUs (``--replica-cpus`` each).

Loopback (``--host 127.0.0.1``, the default) keeps a local Ray instance off other interfaces: Ray binds its node
services to the node address, set to 127.0.0.1 here (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which makes Ray take
the loopback address as the node's), and Ray Serve 2.x binds each replica's gRPC server to ``[::]``, which a
worker setup hook rebinds to 127.0.0.1 (``_loopback_replica_grpc``; it patches a private Ray Serve function and
says so in a warning when that function is not there).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
import warnings

READY_TIMEOUT_S = 300.0


def _environment(loopback: bool) -> None:
    """Ray reads these when imported, so they are set before the import."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # no token file written to ~/.ray
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _loopback_replica_grpc() -> None:
    """A Ray worker setup hook: each replica's gRPC server on 127.0.0.1, not on every interface."""
    try:
        import ray.serve._private.replica as replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        warnings.warn("this Ray Serve has no add_port_to_grpc_server: replicas' gRPC may listen beyond 127.0.0.1",
                      stacklevel=1)
        return
    if getattr(original, "loopback", False):
        return

    def on_loopback(server, address):
        return original(server, address.replace("[::]", "127.0.0.1"))

    on_loopback.loopback = True
    replica.add_port_to_grpc_server = on_loopback


def _builder(argv: list[str], threads: int):
    """What each replica runs to make its app (``serve.ingress``'s builder)."""
    def build_app():
        import torch

        torch.set_num_threads(threads)  # the replica's CPUs: one OpenMP team, sized to what Ray gave it
        from .cli import build, parser

        return build(parser().parse_args(argv))
    return build_app


def start(argv: list[str], replicas: int, host: str = "127.0.0.1", port: int = 8000, replica_cpus: float = 1.0,
          ray_address: str | None = None, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Start Ray (local, or join ``ray_address``), Ray Serve's proxy on ``host:port`` and ``replicas`` replicas of
    ``dllm serve ARGV``; return once they answer. ``stop`` ends them."""
    loopback = host in ("127.0.0.1", "localhost") and ray_address is None
    _environment(loopback)
    import ray
    from ray import serve

    runtime_env = {"worker_process_setup_hook": _loopback_replica_grpc} if loopback else {}
    if ray_address is None:
        ray.init(address="local", num_cpus=max(1, round(replicas * replica_cpus)) + 1, include_dashboard=False,
                 log_to_driver=False, configure_logging=False, object_store_memory=100 * 1024**2,
                 runtime_env=runtime_env)
    else:
        ray.init(address=ray_address, log_to_driver=False, runtime_env=runtime_env)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": host, "port": port})
        deployment = serve.deployment(serve.ingress(_builder(argv, max(1, int(replica_cpus))))(), name="dllm",
                                      num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus})
        serve.run_many([serve.RunTarget(deployment.bind(), name="dllm", route_prefix="/")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        deadline = time.monotonic() + timeout_s
        while True:
            status = serve.status().applications.get("dllm")
            if status is not None and status.status == "RUNNING":
                return
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the replicas did not start: {status.message.strip().splitlines()[-1]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas were not running after {timeout_s:.0f} s")
            time.sleep(0.2)
    except BaseException:
        stop()
        raise


def stop() -> None:
    """End the replicas and the Ray instance this process started (or left the cluster)."""
    import ray

    ray.shutdown()


def serve_forever(argv: list[str], replicas: int, host: str, port: int, replica_cpus: float,
                  ray_address: str | None) -> int:
    """``dllm serve --replicas N``: start, wait for SIGTERM or SIGINT, stop, exit 0."""
    start(argv, replicas, host, port, replica_cpus, ray_address)
    print(f"dllm serve: {replicas} replicas behind Ray Serve on http://{host}:{port}", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    while not stopped.wait(0.5):
        pass
    stop()
    return 0
