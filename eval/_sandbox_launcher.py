"""Sandbox launcher: confine this process tree, then run one untrusted Python program inside it.

Run as a script by `dllm.eval.sandbox` (never imported; standard library only), as
`python -I -S _sandbox_launcher.py CONFIG`, in a fresh session so the parent can kill the whole
process group. It runs in a fresh single-threaded interpreter because forking from the (threaded)
evaluating process and calling ctypes there before exec could deadlock. Steps:

1. resource limits (CPU seconds, address space, file size, open files, processes, no core dumps);
2. new namespaces where permitted (Linux, root): network (no interfaces but a down loopback), mount
   (private tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock, so the program can write only there) and
   PID (the program tree dies with its init process, and cannot signal anything outside);
   Where the interpreter sits under a folder only root may enter, it is re-exposed inside the mount
   namespace (`expose`) so that the unprivileged program can still start;
3. a child that is PID 1 of the new PID namespace forks the program, reaps orphans and exits with
   the program's status (the kernel then kills whatever the program left behind);
4. the program drops root for a fresh unprivileged uid (so RLIMIT_NPROC applies and counts only
   its own processes, and root-owned files are out of reach), sets no_new_privs and execs
   `python -I -S` on a short bootstrap that adds the site-packages directories and runs the file;
5. the launcher exits with the program's status, except that status 0 counts only when the bootstrap
   wrote back this run's random token after the file's last line ran (see `BOOTSTRAP`); otherwise it
   exits with INCOMPLETE. With separate tests (`config["tests"]`) the program's bootstrap is `SERVER`
   instead, and the launcher runs the tests itself, calling into it (`run_tests`): it exits 0 when the
   tests reached their end, TESTS_FAILED otherwise, and kills the program's process when they are done.
   (`_sandbox_calls.py` has both sides.)

What was achieved is written to the report file (marshal format); nothing is skipped silently. With
`--reap UID` it instead kills every process of UID (used when no PID namespace was available).
"""

import ctypes
import errno
import marshal  # config and report format: built in, so no import cost (json adds ~15 ms)
import os
import resource
import signal
import sys
import time

# -I leaves the script's folder off sys.path; put it there for this import only (the
# modules beside it must not shadow the standard library for the tests' own imports).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sandbox_calls import SERVER, WIRE, run_tests  # noqa: E402 - after the path it needs

del sys.path[0]

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 8192, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534
EXEC_FAILED = 125  # exit status when the program could not be started (reported as a sandbox error)
# Exit status when the program exited with status 0 before its last line (no completion token): a
# failure. A program that exits with this status itself is a failure too, so nothing is lost.
INCOMPLETE = 126
TOKEN_BYTES = 16  # 128 random bits a run: no program can guess them
TESTS_FAILED = 1  # exit status when separate tests did not run to their end
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# The program's first lines: `python -I -S` starts fast (no .pth processing); the bootstrap then adds
# the configured site-packages directories and runs the entry file as __main__ (compiling it ourselves
# rather than importing runpy saves ~30 ms a program). It reads the run's completion token from a pipe
# and closes it before the program starts, and writes the token to the done pipe only when the file
# has run to its end without raising: `sys.exit`, `os._exit`, `exit()`, a signal or any exception
# before the last line leaves the done pipe empty. `os.write` is bound before the program runs, so
# patching it, `print` or `sys.stdout` changes nothing; the token is never on disk or in the program.
BOOTSTRAP = (
    "import sys, os\n"
    "def _main(sys, os, write):\n"
    "    path, token_fd, done_fd, *paths = sys.argv[1:]\n"
    "    token = os.read(int(token_fd), 64)\n"
    "    os.close(int(token_fd))\n"
    "    sys.path.extend(paths)\n"
    "    sys.argv = [path]\n"
    "    with open(path, encoding='utf-8') as handle:\n"
    "        code = compile(handle.read(), path, 'exec')\n"
    "    namespace = sys.modules['__main__'].__dict__\n"
    "    del namespace['sys'], namespace['os'], namespace['_main']\n"
    "    namespace['__file__'] = path\n"
    "    exec(code, namespace)\n"
    "    write(int(done_fd), token)\n"
    "_main(sys, os, os.write)\n"
)

def _libc():
    """The C library with prototypes for the calls we make (None where it cannot be loaded)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    # Explicit prototypes: mount's flags are an unsigned long, and an unprototyped call would pass a
    # 32-bit int whose upper register half is undefined.
    c_str, c_ulong = ctypes.c_char_p, ctypes.c_ulong
    for name, argtypes in {
        "unshare": [ctypes.c_int],
        "mount": [c_str, c_str, c_str, c_ulong, ctypes.c_void_p],
        "prctl": [ctypes.c_int, c_ulong, c_ulong, c_ulong, c_ulong],
    }.items():
        if hasattr(libc, name):
            getattr(libc, name).argtypes = argtypes
            getattr(libc, name).restype = ctypes.c_int
    return libc


LIBC = _libc()


def _call(name, *args):
    """Call a libc function; raise OSError on -1 (and when the platform lacks it)."""
    func = getattr(LIBC, name, None)
    if func is None:
        raise OSError(errno.ENOSYS, f"libc has no {name}")
    if func(*args) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def set_limits(limits):
    """Apply the resource limits (soft == hard, so the program cannot raise them); return failures."""
    pairs = {
        "RLIMIT_CPU": limits["cpu_s"],
        "RLIMIT_AS": limits["memory_bytes"],
        "RLIMIT_FSIZE": limits["file_bytes"],
        "RLIMIT_NOFILE": limits["open_files"],
        "RLIMIT_NPROC": limits["processes"],
        "RLIMIT_CORE": 0,
    }
    errors = []
    for name, value in pairs.items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (AttributeError, ValueError, OSError) as exc:  # e.g. macOS refuses to lower RLIMIT_AS
            errors.append(f"{name}: {exc}")
    return errors


def isolate(want, tmpfs_bytes):
    """Enter new network / mount / PID namespaces where allowed; return which ones took effect."""
    got = {"network_isolated": False, "fs_isolated": False, "pid_isolated": False}
    errors = []
    if want["network"]:
        try:
            _call("unshare", CLONE_NEWNET)
            got["network_isolated"] = True
        except OSError as exc:
            errors.append(f"network: {exc}")
    if want["filesystem"]:
        try:
            _call("unshare", CLONE_NEWNS)
            # Private propagation first, or the tmpfs mounts below would appear on the host too.
            _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
            options = f"size={tmpfs_bytes},nr_inodes=4096,mode=1777".encode()
            for path in TMP_DIRS:
                if os.path.isdir(path):
                    _call("mount", b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options)
            got["fs_isolated"] = True
        except OSError as exc:
            errors.append(f"filesystem: {exc}")
    if want["pids"]:
        try:
            _call("unshare", CLONE_NEWPID)  # takes effect for the children forked from here on
            got["pid_isolated"] = True
        except OSError as exc:
            errors.append(f"pids: {exc}")
    if errors:
        got["isolation_errors"] = errors
    return got


def _blocking_ancestor(path):
    """The outermost ancestor directory of `path` that other users cannot enter (None if all can)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if os.path.isdir(current) and not os.stat(current).st_mode & 0o001:
            return current
    return None


def expose(paths):
    """Make `paths` (the interpreter's prefix) reachable by an unprivileged uid; True on success.

    A private interpreter (e.g. pyenv under a mode-700 /root) is unreachable once we drop root. Inside
    our mount namespace we cover each closed ancestor with an empty tmpfs and put back only the
    needed directories, moved there through bind mounts staged in the private /tmp.
    """
    blocked = {p: a for p in paths if (a := _blocking_ancestor(p))}
    if not blocked:
        return True
    staged = {}
    for index, path in enumerate(blocked):
        stage = f"/tmp/.dllm-stage-{index}"
        os.mkdir(stage)
        _call("mount", path.encode(), stage.encode(), None, MS_BIND | MS_REC, None)
        staged[path] = stage
    for ancestor in sorted(set(blocked.values())):
        _call("mount", b"tmpfs", ancestor.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755")
    for path, stage in staged.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        _call("mount", stage.encode(), path.encode(), None, MS_MOVE, None)
        os.rmdir(stage)
    return True


def plan_privilege_drop(config, state):
    """Whether the program will run as an unprivileged uid (root only, interpreter reachable)."""
    if os.geteuid() != 0 or not config["isolate"]["drop_privileges"]:
        return False
    paths = config["expose"]
    if not any(_blocking_ancestor(p) for p in paths):
        return True
    if state["fs_isolated"]:
        try:
            return expose(paths)
        except OSError as exc:
            state.setdefault("isolation_errors", []).append(f"expose interpreter: {exc}")
    state.setdefault("isolation_errors", []).append(
        "privileges: the interpreter is unreachable for an unprivileged uid; the program runs as root"
    )
    return False


def write_files(directory, files):
    """Write the program's files (name -> text) into its working directory."""
    for name, text in files.items():
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(path, 0o644)


def drop_privileges(uid):
    """Become `uid` (falling back to nobody where that uid is not mapped); return the uid used."""
    for candidate in (uid, NOBODY):
        try:
            os.setgroups([])
            os.setgid(candidate)
            os.setuid(candidate)
            return candidate
        except OSError:
            continue
    raise OSError(errno.EPERM, "could not drop privileges")


def exec_program(config, cwd, status_fd, bootstrap, fds):
    """In the program's process: drop privileges, then exec Python on the program (never returns).

    `fds` (the bootstrap's pipes: the token's and the done pipe, or the call pipes with separate tests)
    are the only descriptors the program inherits besides stdin/stdout/stderr; their numbers follow the
    entry file on the bootstrap's command line.
    """
    try:
        if config["drop"]:
            uid = drop_privileges(config["uid"])
            os.write(status_fd, f"uid {uid}\n".encode())
        try:
            _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot regain root
        except OSError:
            pass
        os.chdir(cwd)
        for fd in fds:
            os.set_inheritable(fd, True)
        argv = [config["python"], "-I", "-S", "-c", bootstrap, config["entry"], *map(str, fds)]
        argv += config["sys_path"]
        os.execve(config["python"], argv, dict(config["env"], HOME=cwd, TMPDIR=cwd))
    except BaseException as exc:  # noqa: BLE001 - anything here is a sandbox failure, report it
        os.write(status_fd, f"error {type(exc).__name__}: {exc}\n".encode())
    os._exit(EXEC_FAILED)


def exit_code(status):
    """Shell-style exit code of a wait status (128 + signal for a killed process)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def namespace_init(config, cwd, status_fd, bootstrap, fds):
    """PID 1 of the new namespace: mount its /proc, fork the program, reap everything, pass its status."""
    if config["fs_isolated"]:
        try:
            _call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        except OSError:
            pass  # /proc then still shows the host's processes; they remain unsignalable (other uid)
    try:
        program = os.fork()
    except OSError as exc:
        os.write(status_fd, f"error {type(exc).__name__}: {exc}\n".encode())
        os._exit(EXEC_FAILED)
    if program == 0:
        exec_program(config, cwd, status_fd, bootstrap, fds)
    for fd in (status_fd, *fds):
        os.close(fd)
    while True:
        pid, status = os.wait()
        if pid == program:
            os._exit(exit_code(status))  # our exit tears the namespace down, killing any leftovers


def run(config_path):
    """Confine, start the program, report, and exit with the program's exit code."""
    with open(config_path, "rb") as handle:
        config = marshal.load(handle)
    os.unlink(config_path)  # it holds the tests: a program running as this uid must not read them
    report = open(config["report"], "wb")  # opened before /tmp may be covered
    limit_errors = set_limits(config["limits"])
    state = isolate(config["isolate"], config["tmpfs_bytes"])
    if limit_errors:
        state["limit_errors"] = limit_errors
    cwd = "/tmp" if state["fs_isolated"] else config["workdir"]
    write_files(cwd, config["files"])
    config["fs_isolated"] = state["fs_isolated"]
    config["drop"] = plan_privilege_drop(config, state)
    read_fd, status_fd = os.pipe()  # close-on-exec: EOF once the program has exec'd or failed
    tests = config.get("tests")
    if tests is None:
        token = os.urandom(TOKEN_BYTES).hex().encode()
        token_fd, token_write = os.pipe()
        os.write(token_write, token)  # 32 bytes, far below the pipe's buffer: never blocks
        os.close(token_write)
        done_read, done_fd = os.pipe()
        bootstrap, fds, ours = BOOTSTRAP, (token_fd, done_fd), (done_read,)
    else:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        bootstrap, fds, ours = f"WIRE = {WIRE!r}\n{SERVER}", (request_read, reply_write), (request_write, reply_read)
    child = os.fork()
    if child == 0:
        for fd in (read_fd, *ours):
            os.close(fd)
        if state["pid_isolated"]:
            namespace_init(config, cwd, status_fd, bootstrap, fds)
        exec_program(config, cwd, status_fd, bootstrap, fds)
    for fd in (status_fd, *fds):
        os.close(fd)
    messages = os.fdopen(read_fd, encoding="utf-8").read().splitlines()
    state["privileges_dropped"] = any(m.startswith("uid ") for m in messages)
    state["uid"] = next((int(m.split()[1]) for m in messages if m.startswith("uid ")), os.geteuid())
    state["exec_error"] = next((m[len("error ") :] for m in messages if m.startswith("error ")), None)
    marshal.dump(state, report)  # before the wait: after a timeout the parent still needs the uid
    report.close()
    if tests is not None:
        passed = run_tests(tests, config["sys_path"], request_write, reply_read)
        os.close(request_write)  # the program's side ends at EOF; kill it in case it does not
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(child, 0)
        sys.exit(0 if passed else TESTS_FAILED)
    _, status = os.waitpid(child, 0)
    code = exit_code(status)
    if code == 0 and not ran_to_end(done_read, token):
        os.write(2, b"\n[sandbox] the program exited with status 0 before its last line ran "
                    b"(sys.exit, os._exit, exit() or similar): a failure\n")
        code = INCOMPLETE
    sys.exit(code)


def ran_to_end(done_read, token):
    """Whether the done pipe holds exactly this run's token (written by the bootstrap at the end).

    Read without blocking once the program has exited: a process it left behind may still hold the
    pipe open, and only what was written by then counts. The exit status is the only verdict the
    parent reads, so the program cannot forge a pass by writing the sandbox's files.
    """
    os.set_blocking(done_read, False)
    try:
        written = os.read(done_read, 4 * len(token))
    except BlockingIOError:
        written = b""
    return written == token


def _live_processes(uid):
    """Pids of processes owned by `uid` that are not yet dead (zombies and this process excluded)."""
    pids, me = [], str(os.getpid())
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and entry != me and os.stat(f"/proc/{entry}").st_uid == uid:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    if handle.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        pids.append(int(entry))
        except (OSError, IndexError):
            continue  # exited while we looked
    return pids


def reap(uid):
    """Kill every process owned by `uid`: kill(-1) as that uid reaches exactly those (and not us)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    for _ in range(200):  # a fork loop may add processes while we kill; repeat until none is left
        os.kill(-1, signal.SIGKILL)
        if not _live_processes(uid):
            return
        time.sleep(0.005)
    sys.exit("processes of the sandbox uid survived")


if __name__ == "__main__":
    if sys.argv[1] == "--reap":
        reap(int(sys.argv[2]))
    else:
        run(sys.argv[1])
