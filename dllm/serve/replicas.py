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

Stopping: SIGTERM and SIGINT (a terminal's Ctrl-C, sent to the whole process group) are taken before Ray starts
(``ray.init`` sets its own SIGTERM handler; ours is put back after): a signal while Ray starts ends the start, one
later ends the serving. Either way the application
is deleted first (its replicas drain: requests in flight get ``--grace`` seconds, each replica's
``graceful_shutdown_timeout_s``, while the proxy still passes their answers on), then Ray Serve and Ray shut down,
and a local instance's processes that outlive Ray's own shutdown (its agents, say, when a start was cut short) are
ended, so nothing of Ray's is left; on Linux this process is their subreaper meanwhile, so one whose parent died
stays its descendant and is found. The command exits 0. Should Ray's shutdown itself hang, the command ends its
processes and exits after ``--grace`` + ``STOP_BOUND_S`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
import warnings

from dllm.defaults import SERVE_GRACE_S

READY_TIMEOUT_S = 300.0
STOP_BOUND_S = 30.0  # beyond --grace: Ray Serve's and Ray's own teardown (about 2-5 s on a 2-core CPU)
_DRAIN_POLL_S = 0.2  # how often a stopping replica looks whether its requests have finished (Ray's default: 2 s)
_local = {"before": None}  # a local Ray instance started here: the pids of this process's children before it


def _environment(loopback: bool) -> None:
    """Ray reads these when imported, so they are set before the import."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # no token file written to ~/.ray
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray's SIGTERM handler (ours replaces it once ray.init returns) would otherwise wait up to 30 s for the node
    # to drain when a SIGTERM comes during ray.init.
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")


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
          ray_address: str | None = None, timeout_s: float = READY_TIMEOUT_S, grace: float = SERVE_GRACE_S,
          stopping: threading.Event | None = None) -> None:
    """Start Ray (local, or join ``ray_address``), Ray Serve's proxy on ``host:port`` and ``replicas`` replicas of
    ``dllm serve ARGV``; return once they answer, or as soon as ``stopping`` is set (``serve_forever``'s signal
    handlers set it, and are put back after ``ray.init``, which sets its own). ``stop`` ends them."""
    if stopping is not None and stopping.is_set():
        return
    loopback = host in ("127.0.0.1", "localhost") and ray_address is None
    _environment(loopback)
    import ray
    from ray import serve

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    runtime_env = {"worker_process_setup_hook": _loopback_replica_grpc} if loopback else {}
    try:
        if ray_address is None:
            _local["before"] = {child.pid for child in _children()}
            _subreaper(True)
            ray.init(address="local", num_cpus=max(1, round(replicas * replica_cpus)) + 1, include_dashboard=False,
                     log_to_driver=False, configure_logging=False, object_store_memory=100 * 1024**2,
                     runtime_env=runtime_env)
        else:
            ray.init(address=ray_address, log_to_driver=False, runtime_env=runtime_env)
        _restore(handlers, stopping)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if stopping is not None and stopping.is_set():
            return
        serve.start(http_options={"host": host, "port": port})
        deployment = serve.deployment(serve.ingress(_builder(argv, max(1, int(replica_cpus))))(), name="dllm",
                                      num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
                                      graceful_shutdown_timeout_s=grace,
                                      graceful_shutdown_wait_loop_s=min(_DRAIN_POLL_S, grace) or _DRAIN_POLL_S)
        serve.run_many([serve.RunTarget(deployment.bind(), name="dllm", route_prefix="/")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        deadline = time.monotonic() + timeout_s
        while stopping is None or not stopping.is_set():
            status = serve.status().applications.get("dllm")
            if status is not None and status.status == "RUNNING":
                return
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the replicas did not start: {status.message.strip().splitlines()[-1]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas were not running after {timeout_s:.0f} s")
            time.sleep(0.2)
    except BaseException:
        _restore(handlers, stopping)
        stop()
        raise


def _restore(handlers: dict, stopping: threading.Event | None) -> None:
    """Put the caller's signal handlers back in place of Ray's (when the caller takes signals: ``stopping``)."""
    if stopping is not None:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def stop(grace: float = SERVE_GRACE_S) -> None:
    """End the replicas (requests in flight get ``grace`` seconds, set when they started), Ray Serve and the Ray
    instance this process started, then any process of that instance still alive; joined to a cluster, delete
    this server's application and leave the cluster."""
    if "ray" not in sys.modules:  # stopped before Ray was even imported: nothing to end
        return
    import ray
    from ray import serve

    left = _local_processes()
    try:
        if ray.is_initialized():
            with contextlib.suppress(Exception):  # a start cut short may have no Serve yet: Ray goes all the same
                serve.delete("dllm")  # the replicas drain while the proxy still passes their answers on
                if _local["before"] is not None:
                    serve.shutdown()
    finally:
        ray.shutdown()
        _end(left)
        for _ in range(5):  # orphans adopted since (a process whose parent Ray killed first): this one reaps them
            left = _local_processes()
            if not left:
                break
            _end(left)
        if _local["before"] is not None:
            _subreaper(False)
        _local["before"] = None


def serve_forever(argv: list[str], replicas: int, host: str, port: int, replica_cpus: float,
                  ray_address: str | None, grace: float = SERVE_GRACE_S) -> int:
    """``dllm serve --replicas N``: start, serve until SIGTERM or SIGINT (either, at any moment from here on), stop
    within ``grace`` + ``STOP_BOUND_S`` seconds, exit 0."""
    stopping, stopped_by = threading.Event(), []

    def on_signal(signum, frame) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        start(argv, replicas, host, port, replica_cpus, ray_address, grace=grace, stopping=stopping)
    except SystemExit as error:  # Ray's own SIGTERM handlers, in place while ray.init runs, exit 15 or 1
        if error.code not in (signal.SIGTERM, 1):
            raise
        stopped_by.append("SIGTERM")  # (start has stopped Ray)
        stopping.set()
    if not stopping.is_set():
        print(f"dllm serve: {replicas} replicas behind Ray Serve on http://{host}:{port}", flush=True)
    while not stopping.wait(0.5):
        pass
    left = _local_processes()
    watchdog = threading.Timer(grace + STOP_BOUND_S, _abandon, (left,))
    watchdog.daemon = True
    watchdog.start()
    stop(grace)
    watchdog.cancel()
    print(f"dllm serve: stopped by {stopped_by[0]}", file=sys.stderr)
    return 0


def _local_processes() -> list:
    """Every process of the local Ray instance this process started: its children since (Ray's, by their command
    line: an orphan of another child could be adopted too), and theirs."""
    if _local["before"] is None:
        return []
    import psutil

    found = []
    for child in _children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in _local["before"] and "ray" in " ".join([child.name(), *child.cmdline()]):
                found += [child, *child.children(recursive=True)]
    return found


def _subreaper(on: bool) -> None:
    """Linux: make this process the subreaper of its descendants (orphans are reparented to it, not to init)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # 36: PR_SET_CHILD_SUBREAPER


def _children() -> list:
    """This process's children (psutil: Ray's copy, on the path once Ray is imported)."""
    import psutil

    return psutil.Process().children()


def _end(processes: list) -> None:
    """SIGTERM to those still alive, SIGKILL to those alive 3 s later."""
    import psutil

    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running():
                process.terminate()
                alive.append(process)
    _, alive = psutil.wait_procs(alive, timeout=3)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=3)


def _abandon(processes: list) -> None:
    """The watchdog: Ray's shutdown hung; end its processes and this one (exit 0: the server did stop)."""
    print(f"dllm serve: Ray did not stop within {STOP_BOUND_S:.0f} s after the grace; its processes were ended",
          file=sys.stderr, flush=True)
    _end(processes)
    os._exit(0)
