"""The sandbox against hostile programs: each must end as a failure within its timeout and leave the
machine, the evaluating process and other programs' results intact.

Isolation checks that need root and Linux namespaces are skipped with a reason elsewhere. The fork
bomb runs only after the bounded fork test has shown the process limit in force.
"""

import json
import os
import signal
import socket
import sys
import textwrap
import time

import pytest

from dllm.eval import sandbox
from dllm.eval.sandbox import Isolation, Limits, run_many, run_program

IS_ROOT_ON_LINUX = sys.platform.startswith("linux") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT_ON_LINUX, reason="namespaces and uid switching need root on Linux")
SANDBOX_UID_FLOOR = 1_000_000_000  # sandbox._fresh_uid draws uids from here up


def program(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def processes_of(uids: set[int]) -> list[int]:
    """Pids of live (not zombie) processes owned by any of `uids`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if uid in uids and state != "Z":  # a zombie is dead, awaiting its reaper
                pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def no_leftover_processes(monkeypatch):
    """Every test must leave no process running under the uids its programs ran as.

    Only this test's uids are checked: other sessions may be running sandboxes on the machine too.
    """
    used: set[int] = set()
    draw = sandbox._fresh_uid

    def recording_draw() -> int:
        uid = draw()
        used.add(uid)
        return uid

    monkeypatch.setattr(sandbox, "_fresh_uid", recording_draw)
    yield
    if sys.platform.startswith("linux"):
        deadline = time.monotonic() + 5.0
        while processes_of(used) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_of(used) == []


def test_passing_and_failing_programs():
    ok = run_program("print('hello')")
    assert (ok.passed, ok.status, ok.returncode, ok.stdout) == (True, "passed", 0, "hello\n")
    bad = run_program("assert 1 + 1 == 3")
    assert (bad.passed, bad.status, bad.returncode) == (False, "failed", 1)
    assert "AssertionError" in bad.stderr and bad.duration > 0


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("DLLM_SECRET_TOKEN", "do-not-leak")
    result = run_program("import os; print(sorted(os.environ))")
    assert "DLLM_SECRET_TOKEN" not in result.stdout and result.passed


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", timeout=1.0)
    assert (result.status, result.passed) == ("timeout", False)
    assert time.monotonic() - start < 5.0


def test_memory_bomb_fails():
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n"
    result = run_program(bomb, timeout=10.0, limits=Limits(memory_bytes=256 << 20))
    assert result.status == "failed" and "MemoryError" in result.stderr


def test_huge_allocation_fails_fast():
    result = run_program("x = bytearray(8 << 30)", limits=Limits(memory_bytes=512 << 20))
    assert result.status == "failed" and "MemoryError" in result.stderr


def test_output_flood_is_capped():
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout=5.0)
    assert not result.passed and len(result.stdout) <= sandbox.TAIL_BYTES


def test_bounded_fork_loop_hits_the_process_limit():
    """Checked before the fork bomb: the limit must stop a fork loop well short of the machine's."""
    result = run_program(
        program(
            """
            import os, time
            for i in range(100):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            """
        ),
        limits=Limits(processes=16),
        timeout=10.0,
    )
    assert result.status == "failed" and "BlockingIOError" in result.stderr


@needs_root
def test_fork_bomb_is_contained():
    bomb = program(
        """
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()  # try to leave the process group the sandbox kills
            except OSError:
                pass
        """
    )
    start = time.monotonic()
    result = run_program(bomb, timeout=2.0)
    assert result.status == "timeout" and time.monotonic() - start < 8.0
    assert run_program("print('still fine')").passed


@needs_root
def test_writes_outside_the_sandbox_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)  # even a world-writable folder outside must stay out of reach
    result = run_program(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "failed" and not target.exists()
    sibling = run_program("open('../escaped.txt', 'w').write('x')")
    assert sibling.status == "failed"
    assert run_program("open('scratch.txt', 'w').write('own folder is fine')").passed


@needs_root
def test_network_is_unreachable():
    """Loopback only: a listening socket here must never see a connection from the program."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        result = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        assert result.status == "failed" and "Error" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()
    assert result.isolation["network_isolated"] is True


@needs_root
@pytest.mark.parametrize("pids", [True, False])
def test_killing_the_parent_or_evaluator_fails(pids):
    evaluator = os.getpid()
    hostile = program(
        f"""
        import os, signal
        for pid in (os.getppid(), {evaluator}, 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.killpg(0, signal.SIGKILL)
        """
    )
    result = run_program(hostile, isolation=Isolation(pids=pids))
    assert not result.passed and result.status in ("failed", "error")
    assert os.getpid() == evaluator  # we are alive to check


@needs_root
def test_isolation_flags_are_recorded():
    result = run_program("import os\nprint(os.getuid())")
    assert result.isolation == {
        "network_isolated": True,
        "fs_isolated": True,
        "pid_isolated": True,
        "privileges_dropped": True,
    }
    assert int(result.stdout) >= SANDBOX_UID_FLOOR


def test_refused_protections_are_recorded_not_silent():
    result = run_program("pass", isolation=Isolation(network=False, filesystem=False, pids=False))
    assert result.passed
    assert result.isolation["network_isolated"] is False and result.isolation["pid_isolated"] is False


@needs_root
def test_escaped_children_are_reaped_without_a_pid_namespace():
    """With no PID namespace the leftovers are killed by uid (checked by the autouse fixture)."""
    escape = program(
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
            os._exit(0)
        print('parent done')
        """
    )
    result = run_program(escape, isolation=Isolation(pids=False))
    assert result.passed and result.isolation["pid_isolated"] is False


def test_program_that_cannot_start_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "PYTHON", "/nonexistent/python3")
    result = run_program("pass")
    assert (result.status, result.passed) == ("error", False)
    assert "could not start program" in result.stderr


def test_run_many_keeps_order_and_isolates_programs():
    good = "print('ok')"
    programs = [
        good,
        "while True:\n    pass\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "x = bytearray(8 << 30)",
        good,
    ]
    start = time.monotonic()
    results = run_many(programs, timeout=2.0, max_workers=2)
    assert [r.status for r in results] == ["passed", "timeout", "timeout", "failed", "passed"]
    assert time.monotonic() - start < 10.0


def test_run_many_empty():
    assert run_many([]) == []


def test_signal_death_counts_as_failure():
    result = run_program("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.status == "failed" and result.returncode == 128 + signal.SIGSEGV


EARLY_EXITS = {
    "sys.exit": "import sys\nsys.exit(0)",
    "sys.exit()": "import sys\nsys.exit()",
    "os._exit": "import os\nos._exit(0)",
    "exit": "exit()",
    "quit": "quit(0)",
    "raise SystemExit": "raise SystemExit",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "SIGKILL self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "close stdout": "import os, sys\nsys.stdout.close()\nos.close(1)\nos._exit(0)",
    "redirect stdout": "import io, sys\nsys.stdout = io.StringIO()\nsys.exit(0)",
    "patch print": "import builtins, os\nbuiltins.print = lambda *a, **k: None\nos._exit(0)",
    "patch os.write": "import os\nos.write = lambda fd, data: len(data)\nraise SystemExit",
    "exit from a thread": (
        "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\ntime.sleep(5)"
    ),
    "forged tokens on every fd": (
        "import os\n"
        "for fd in range(3, 256):\n"
        "    for fake in (b'0' * 32, os.urandom(16).hex().encode(), b'done\\n'):\n"
        "        try:\n"
        "            os.write(fd, fake)\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)"
    ),
    "read the token pipe itself": (  # it was closed before the program started: nothing to read
        "import os\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        data = os.read(fd, 64)\n"
        "    except OSError:\n"
        "        continue\n"
        "    for out in range(3, 256):\n"
        "        try:\n"
        "            os.write(out, data)\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)"
    ),
}


@pytest.mark.parametrize("exit_code", list(EARLY_EXITS.values()), ids=list(EARLY_EXITS))
def test_program_that_ends_before_its_tests_fails(exit_code):
    """A pass means the last line ran: every way of ending early with status 0 (or by a signal) fails."""
    result = run_program(f"{exit_code}\nassert False, 'the tests'\n", timeout=5.0)
    assert (result.passed, result.status) == (False, "failed")
    assert result.returncode != 0


@pytest.mark.parametrize("isolation", [Isolation(), Isolation(network=False, filesystem=False, pids=False)])
def test_early_exit_fails_with_and_without_namespaces(isolation):
    result = run_program("import sys\nsys.exit(0)\nassert False\n", isolation=isolation)
    assert result.status == "failed" and "before its last line" in result.stderr
    ran = run_program("import sys\nprint('tests ran')\n", isolation=isolation)
    assert ran.passed and ran.returncode == 0


def test_programs_that_run_to_their_end_still_pass():
    """Closing stdout, patching print or exiting with status 0 from a finally after the end are fine."""
    done = [
        "import os, sys\nsys.stdout.close()\nos.close(1)\nx = 1\nassert x == 1\n",
        "import builtins\nbuiltins.print = None\nassert True\n",
        "import atexit, os\natexit.register(os._exit, 0)\nassert 2 + 2 == 4\n",
        "import sys\ndef f():\n    return sys.argv\nassert f() == [__file__] and __name__ == '__main__'\n",
    ]
    assert [r.status for r in run_many(done, max_workers=2)] == ["passed"] * len(done)


def test_the_completion_token_is_not_visible_to_the_program():
    """Nothing the program can name holds the token: no global, no argument, no readable descriptor."""
    probe = program(
        """
        import json, os, sys
        readable = []
        for fd in range(3, 64):
            try:
                os.set_blocking(fd, False)
                readable.append(os.read(fd, 64).decode())
            except OSError:
                pass
        names = sorted(n for n in globals() if not n.startswith('__'))
        print(json.dumps([names, sys.argv, readable]))
        """
    )
    result = run_program(probe)
    assert result.passed, result.stderr
    names, argv, readable = json.loads(result.stdout)
    assert names == ["fd", "json", "os", "readable", "sys"] and argv == ["main.py"] and readable == []


FORGER = program(
    """
    import os, sys
    frame, found = sys._getframe(0), {}
    while frame is not None:  # every frame above the file: the bootstrap's locals included
        found.update({k: v for k, v in frame.f_locals.items() if k in ("write", "done_fd", "token", "reply")})
        frame = frame.f_back
    if "token" in found:  # the in-process verdict: hand the bootstrap's token back, then leave
        found["write"](int(found["done_fd"]), found["token"])
    else:  # whatever pipe reaches the tests: fake answers on each
        fake = repr(("ok", 4)).encode()
        for fd in range(3, 64):
            try:
                os.write(fd, len(fake).to_bytes(8, "big") + fake)
            except OSError:
                pass
    sys.exit(0)
    """
)


def test_a_program_that_reads_the_bootstrap_frame_cannot_forge_a_pass():
    """The three-line forgery of issue 12 item 5, grown: it wins where the verdict is the program's own
    (no separate tests: the token is in its interpreter), and fails once the tests run apart."""
    assert run_program(FORGER + "assert False\n", timeout=10).passed  # the design limit, still there
    result = run_program(FORGER, tests="assert f(2) == 4\n", timeout=10)
    assert not result.passed and result.status == "failed"
    assert not run_program(FORGER.replace("sys.exit(0)", "def f(x):\n    return x + 1"), tests="assert f(2) == 4\n",
                           timeout=10).passed


def test_separate_tests_call_into_the_program_and_see_its_values():
    """Plain data crosses both ways (non-finite floats, sets, bytes, complex, subclasses as their base),
    other objects by name; the program's exceptions arrive as the built-in class; state persists."""
    solution = program(
        """
        import math
        calls = []
        class Node:
            def __init__(self, value):
                self.value = value
        root = Node(7)
        def f(x, scale=1):
            calls.append(x)
            return {"x": x * scale, "s": {1, 2}, "e": frozenset(), "inf": math.inf, "b": b"\\x00", "c": 1j}
        def value_of(node):
            return node.value
        def count():
            return len(calls)
        def fail(kind):
            raise {"value": ValueError, "key": KeyError}[kind]("no")
        def opaque():
            return Node(1)
        def counted():  # a dict subclass crosses as a dict (MBPP 40 and 88 return Counters)
            import collections
            return collections.Counter("aab")
        """
    )
    tests = program(
        """
        import math
        out = f(3, scale=2)
        assert out == {"x": 6, "s": {1, 2}, "e": frozenset(), "inf": math.inf, "b": b"\\x00", "c": 1j}
        assert f((1, [2.5])) ["x"] == (1, [2.5]) and count() == 2 and value_of(root) == 7
        assert counted() == {"a": 2, "b": 1}
        for kind, cls in (("value", ValueError), ("key", KeyError)):
            try:
                fail(kind)
            except cls:
                pass
            else:
                raise AssertionError(kind)
        print("tests ran to the end")
        """
    )
    result = run_program(solution, tests=tests, timeout=10)
    assert result.passed, result.stderr
    assert result.stdout == "tests ran to the end\n"
    unsendable = run_program(solution, tests="opaque()\n", timeout=10)
    assert not unsendable.passed and "a Node cannot cross between the program and its tests" in unsendable.stderr
    with pytest.raises(ValueError, match="tests must give one entry per source: 1 for 2 sources"):
        run_many([solution, solution], tests=["pass\n"])


def test_separate_tests_stay_out_of_the_programs_reach():
    """The program cannot read the tests (not on disk, not in its process) nor end them early."""
    probe = program(
        """
        import os
        seen = []
        for root in ("..", "/tmp", os.getcwd()):
            for name in os.listdir(root) if os.path.isdir(root) else []:
                try:
                    with open(os.path.join(root, name), "rb") as handle:
                        seen.append(b"MARKER-" + b"41" in handle.read())  # (not its own text)
                except OSError:
                    pass
        print("read the tests" if any(seen) else "did not read the tests", flush=True)
        def f():
            os._exit(0)
        """
    )
    result = run_program(probe, tests="# MARKER-41\nf()\n", timeout=10)
    assert result.stdout.startswith("did not read the tests") and not result.passed
    assert "ended (exit, crash or kill) before answering" in result.stderr
