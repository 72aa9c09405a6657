"""Count the operations that make the host wait for the device (device-to-host synchronisations).

    with count_syncs(as_gpu=True) as syncs:
        dllm.generate(model, prompt, sampler="fef", window=8)
    syncs.count, syncs.by_op  # Counter({"item": 3, "nonzero": 2, ...})

On a GPU every such operation stalls the pipeline: the host waits until the device has run everything queued
before it can go on. ``count_syncs`` counts them with a ``TorchFunctionMode`` (``torch.overrides``), so it works on
a CPU-only machine too: ``as_gpu=True`` counts what WOULD synchronise if the run's tensors lived on a GPU.

Where the list comes from: PyTorch's CUDA sync debug mode (``torch.cuda.set_sync_debug_mode``) flags every call
that ends in a stream synchronisation or a blocking copy; its own test (``test_torch.py: test_sync_warning``)
lists what syncs and what does not, and the list here follows it:

- reading a value on the host: ``item``, ``tolist``, ``__bool__`` (``if t:``), ``__int__``, ``__float__``,
  ``__complex__``, ``__index__``, ``__format__``, ``__repr__``, ``__contains__``, ``numpy``, ``__array__``,
  ``is_nonzero``, ``equal``, ``allclose``;
- outputs whose shape depends on values: ``nonzero`` (``as_tuple`` too), ``argwhere``, one-argument ``where``,
  ``unique``, ``unique_consecutive``, ``masked_select``, ``bincount``, ``histc`` with min = max = 0,
  ``repeat_interleave`` with tensor ``repeats`` and no ``output_size``, ``one_hot`` without ``num_classes``;
  indexing or index-assignment (``__getitem__``, ``__setitem__``, ``index_put(_)``) with a boolean device tensor,
  except ``t[mask] = number`` (a ``masked_fill``, which torch's test lists as not syncing);
- blocking copies between host and device: ``cpu``, ``to``, ``cuda``, ``copy_`` (not with
  ``non_blocking=True``), ``tensor`` / ``as_tensor`` / ``asarray`` / ``new_tensor`` of host data onto the device,
  ``t[...] = host_tensor``, and indexing a device tensor with a host integer tensor or a Python list (torch's test
  counts ``x[ind_cpu]``, and not ``x[mask_cpu]``);
- a device tensor read as a number by a factory (``arange(t)``, ``full(size, t)``) or as a slice bound (``x[:t]``).

Not counted, as in torch's test: arithmetic, reductions that return tensors (``sum``, ``any``, ``argmax``),
``gather``, ``where(c, a, b)``, ``multinomial``, ``randperm``, shape reads (``shape``, ``numel``, ``size``).
Not seen at all: ``torch.cuda.synchronize`` and stream or event waits (not tensor operations), and reads inside a
torch function implemented in Python that handles ``__torch_function__`` itself (it is seen as one call: those
above are listed by their outer name).

The rule for ``as_gpu`` (the key use: a CPU test that tells how many synchronisations a round would make on a
GPU). A tensor is a device tensor when it lives on an accelerator; with ``as_gpu`` a CPU tensor is one too,
unless the counter saw it made for the host inside the counted region: by a factory called without ``device``
or with the string ``"cpu"`` (a ``torch.device``, as code writes ``device=x.device``, is taken for the
accelerator), by ``cpu()`` / ``to("cpu")``, or by an operation whose tensor inputs are all host tensors. Tensors
made before the region (the prompt, the weights) are device tensors. ``as_gpu`` defaults to True on a machine
without CUDA (there is nothing else to count) and False with it (count what really syncs).

Cheap when not active: nothing is installed outside ``count_syncs``; inside, every torch call goes through one
Python function (a decode runs a few times slower: count in an extra or untimed pass, never a timed one).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SyncCount", "count_syncs"]


@dataclass
class SyncCount:
    """What ``count_syncs`` counted: ``count`` synchronising operations, ``by_op`` per operation name, and with
    ``stacks=True`` ``sites``: per "op at file:line (function)", the first frame outside torch."""

    as_gpu: bool
    stacks: bool = False
    count: int = 0
    by_op: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    _paused: int = 0

    def add(self, op: str) -> None:
        if self._paused:
            return
        self.count += 1
        self.by_op[op] += 1
        if self.stacks:
            self.sites[f"{op} at {_caller()}"] += 1

    @contextlib.contextmanager
    def paused(self):
        """Count nothing inside (e.g. a recording callback that is not part of the decode being measured)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1


@contextlib.contextmanager
def count_syncs(as_gpu: bool | None = None, stacks: bool = False):
    """Count the synchronising torch operations run inside (module docstring) -> a ``SyncCount``.

    ``as_gpu``: count CPU tensors as device tensors (the rule above; default: when CUDA is unavailable).
    ``stacks``: also record where each one was called from (slower). Contexts nest: each counts what runs in it.
    """
    tally = SyncCount(as_gpu=not torch.cuda.is_available() if as_gpu is None else bool(as_gpu), stacks=stacks)
    with _SyncMode(tally):
        yield tally


# --------------------------------------------------------------------------------------------------------
# The mode
# --------------------------------------------------------------------------------------------------------


class _SyncMode(TorchFunctionMode):
    """Counts by the rules below, keyed by the called function's name; with ``as_gpu`` it also keeps the set of
    host tensors (module docstring)."""

    def __init__(self, tally: SyncCount):
        super().__init__()
        self.tally = tally
        self.host: dict[int, weakref.ref] = {}  # id -> tensor made for the host in the region (as_gpu only)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        rule = _RULES.get(name)
        if rule is not None:
            op = rule(self, args, kwargs)
            if op:
                self.tally.add(op)
        result = func(*args, **kwargs)
        return self._place(name, args, kwargs, result) if self.tally.as_gpu else result

    # Where a tensor lives ------------------------------------------------------------------------------

    def on_device(self, value) -> bool:
        """``value`` is a tensor on the device (an accelerator, or with ``as_gpu`` any tensor not made for the host)."""
        if not isinstance(value, torch.Tensor):
            return False
        if value.device.type != "cpu":
            return True
        if not self.tally.as_gpu:
            return False
        ref = self.host.get(id(value))
        return ref is None or ref() is not value

    def on_host(self, value) -> bool:
        return isinstance(value, torch.Tensor) and not self.on_device(value)

    def dest_is_device(self, device) -> bool:
        """A ``device=`` argument names the device (not the host): with ``as_gpu``, anything but a "cpu" string."""
        if isinstance(device, torch.Tensor):
            return self.on_device(device)
        if self.tally.as_gpu:
            return not (isinstance(device, str) and device.startswith("cpu"))
        return torch.device(device).type != "cpu" if not isinstance(device, int) else True

    def _place(self, name, args, kwargs, result):
        """Track the host tensors among ``result`` (``as_gpu``): a copy's destination, a factory's device, or the
        inputs' (all host: host). A result that is one of its inputs keeps its place, unless the call moved it
        (then an alias stands for the moved tensor, since on a CPU ``to`` returns the tensor itself)."""
        outputs = [result] if isinstance(result, torch.Tensor) else \
            [r for r in result if isinstance(r, torch.Tensor)] if isinstance(result, tuple | list) else []
        if not outputs:
            return result
        inputs = _tensors(args, kwargs)
        moved = _MOVES.get(name)
        host = moved(self, args, kwargs) if moved is not None else None
        if host is None:
            host = all(self.on_host(t) for t in inputs) if inputs else _factory_on_host(kwargs)
        elif isinstance(result, torch.Tensor) and any(result is t for t in inputs) and host != self.on_host(result):
            result = outputs[0] = result.view_as(result)
        for out in outputs:
            if any(out is t for t in inputs):
                continue
            if host:
                key = id(out)
                self.host[key] = weakref.ref(out, lambda _, key=key, host=self.host: host.pop(key, None))
            else:
                self.host.pop(id(out), None)
        return result


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """Tensor arguments, one level into lists and tuples (``cat``'s list, an index tuple)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, tuple | list):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _factory_on_host(kwargs) -> bool:
    device = kwargs.get("device")
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


def _caller() -> str:
    """The first frame outside torch and this module: where the synchronising call was written."""
    frame = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        path = frame.f_code.co_filename
        if os.path.abspath(path) != here and f"{os.sep}torch{os.sep}" not in path and "contextlib" not in path:
            return f"{os.path.relpath(path) if not path.startswith('<') else path}:{frame.f_lineno} " \
                   f"({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


# --------------------------------------------------------------------------------------------------------
# The rules: function name -> (mode, args, kwargs) -> the op's label when it synchronises, else None
# --------------------------------------------------------------------------------------------------------


def _read(name):
    """A value read on the host: synchronises when any tensor argument is on the device."""
    return lambda mode, args, kwargs: name if any(mode.on_device(t) for t in _tensors(args, kwargs)) else None


def _shaped_by_values(name):
    """An output whose shape depends on the input's values (the first argument)."""
    return lambda mode, args, kwargs: name if args and mode.on_device(args[0]) else None


def _where(mode, args, kwargs):
    return "where (one argument)" if len(args) == 1 and not kwargs and mode.on_device(args[0]) else None


def _repeat_interleave(mode, args, kwargs):
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
    if kwargs.get("output_size") is None and mode.on_device(repeats):
        return "repeat_interleave (tensor repeats, no output_size)"
    return None


def _one_hot(mode, args, kwargs):
    classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return "one_hot (no num_classes)" if classes == -1 and mode.on_device(args[0]) else None


def _histc(mode, args, kwargs):
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return "histc (min = max = 0)" if low == high == 0 and mode.on_device(args[0]) else None


def _index_problem(mode, target, index) -> str | None:
    """Why indexing ``target`` with ``index`` synchronises: a device bool mask (data-dependent shape), a host index
    tensor or list into a device tensor (a blocking copy), a device tensor as a slice bound (read as an int)."""
    for item in index if isinstance(index, tuple) else (index,):
        if isinstance(item, torch.Tensor):
            if item.dtype in (torch.bool, torch.uint8) and mode.on_device(item):
                return "bool mask"
            if mode.on_device(target) and mode.on_host(item) and item.dim() > 0 and item.dtype != torch.bool:
                return "host index"
        elif isinstance(item, list) and mode.on_device(target):
            return "host index"
        elif isinstance(item, slice) and any(mode.on_device(b) for b in (item.start, item.stop, item.step)):
            return "tensor slice bound"
    return None


def _getitem(mode, args, kwargs):
    problem = _index_problem(mode, args[0], args[1])
    return f"__getitem__ ({problem})" if problem else None


def _setitem(mode, args, kwargs):
    target, index, value = args
    problem = _index_problem(mode, target, index)
    if problem == "bool mask" and not isinstance(index, tuple) and not isinstance(value, torch.Tensor):
        problem = None  # t[mask] = number is masked_fill: no sync (torch's test)
    if problem is None and mode.on_device(target) and mode.on_host(value) and value.dim() > 0:
        problem = "host value"
    return f"__setitem__ ({problem})" if problem else None


def _index_put(mode, args, kwargs):
    target = args[0]
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    values = args[2] if len(args) > 2 else kwargs.get("values")
    problem = _index_problem(mode, target, tuple(indices))
    if problem is None and mode.on_device(target) and mode.on_host(values) and values.dim() > 0:
        problem = "host value"
    return f"index_put ({problem})" if problem else None


def _copy_label(name, source_on_device: bool, dest_on_device: bool) -> str | None:
    if source_on_device == dest_on_device:
        return None
    return f"{name} ({'device->host' if source_on_device else 'host->device'})"


def _to_destination(mode, args, kwargs):
    """``Tensor.to``'s destination -> (on the device?, non_blocking); None for a dtype-only call."""
    device, non_blocking = kwargs.get("device"), bool(kwargs.get("non_blocking", False))
    for value in args[1:]:
        if isinstance(value, bool):
            non_blocking = non_blocking or value
        elif isinstance(value, torch.Tensor | str | torch.device | int) and device is None:
            device = value
    return (None if device is None else mode.dest_is_device(device)), non_blocking


def _to(mode, args, kwargs):
    dest, non_blocking = _to_destination(mode, args, kwargs)
    if dest is None or non_blocking:
        return None
    return _copy_label("to", mode.on_device(args[0]), dest)


def _cpu(mode, args, kwargs):
    return "cpu (device->host)" if mode.on_device(args[0]) else None


def _cuda(mode, args, kwargs):
    non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
    return None if non_blocking else _copy_label("cuda", mode.on_device(args[0]), True)


def _copy_(mode, args, kwargs):
    non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
    return None if non_blocking else _copy_label("copy_", mode.on_device(args[1]), mode.on_device(args[0]))


def _made_from_data(name):
    """``tensor`` / ``as_tensor`` / ``asarray``: the data (a host tensor, or Python/NumPy data) onto ``device``."""
    def rule(mode, args, kwargs):
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        device = kwargs.get("device", args[2] if name == "as_tensor" and len(args) > 2 else None)
        source = mode.on_device(data)
        dest = source if device is None and isinstance(data, torch.Tensor) else \
            (False if device is None else mode.dest_is_device(device))
        return _copy_label(name, source, dest)
    return rule


def _new_tensor(mode, args, kwargs):
    device = kwargs.get("device")
    dest = mode.on_device(args[0]) if device is None else mode.dest_is_device(device)
    data = args[1] if len(args) > 1 else kwargs.get("data")
    return _copy_label("new_tensor", mode.on_device(data), dest)


def _number_from_tensor(name, skip: int = 0):
    """A factory reading a device tensor where a number goes (``arange(t)``, ``full(size, t)``)."""
    def rule(mode, args, kwargs):
        return f"{name} (tensor as a number)" if any(mode.on_device(t) for t in _tensors(args[skip:], kwargs)) \
            else None
    return rule


_RULES = {
    **{name: _read(name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__complex__",
                                      "__index__", "__format__", "__repr__", "__contains__", "numpy", "__array__",
                                      "is_nonzero", "equal", "allclose")},
    **{name: _shaped_by_values(name) for name in ("nonzero", "argwhere", "unique", "unique_consecutive",
                                                  "masked_select", "bincount")},
    "where": _where, "repeat_interleave": _repeat_interleave, "one_hot": _one_hot, "histc": _histc,
    "__getitem__": _getitem, "__setitem__": _setitem, "index_put_": _index_put, "index_put": _index_put,
    "to": _to, "cpu": _cpu, "cuda": _cuda, "copy_": _copy_,
    **{name: _made_from_data(name) for name in ("tensor", "as_tensor", "asarray")},
    "new_tensor": _new_tensor,
    **{name: _number_from_tensor(name) for name in ("arange", "range", "linspace", "logspace", "full", "zeros",
                                                    "ones", "empty", "rand", "randn", "randint", "eye", "randperm")},
    **{name: _number_from_tensor(name, skip=1) for name in ("new_full", "new_zeros", "new_ones", "new_empty")},
}


def _to_place(mode, args, kwargs):
    dest, _ = _to_destination(mode, args, kwargs)
    return None if dest is None else not dest


def _made_place(name):
    def place(mode, args, kwargs):
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        device = kwargs.get("device", args[2] if name == "as_tensor" and len(args) > 2 else None)
        if device is None:
            return mode.on_host(data) if isinstance(data, torch.Tensor) else True
        return not mode.dest_is_device(device)
    return place


# Calls that decide their result's place themselves (name -> (mode, args, kwargs) -> on the host?; None: the
# inputs decide): copies and the factories that take data.
_MOVES = {
    "cpu": lambda mode, args, kwargs: True,
    "cuda": lambda mode, args, kwargs: False,
    "to": _to_place,
    **{name: _made_place(name) for name in ("tensor", "as_tensor", "asarray")},
    "new_tensor": lambda mode, args, kwargs: not (mode.on_device(args[0]) if kwargs.get("device") is None
                                                  else mode.dest_is_device(kwargs["device"])),
}
