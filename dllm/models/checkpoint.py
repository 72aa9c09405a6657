"""Fill a module built on the meta device from safetensors files (one or sharded), one tensor at a time.

Big checkpoints (LLaDA-8B: 16 GB in bf16) must load without a float32 copy and without a second copy of the weights
in host memory. The file format and placement are the field's libraries: ``safetensors.safe_open`` memory-maps a
file and reads it tensor by tensor, accelerate places tensors (``set_module_tensor_to_device``), plans a multi-GPU
split (``infer_auto_device_map``) and dispatches (``dispatch_model``). What is ours is the weight-name table
(``rename``) with fused targets, refusing a checkpoint that does not fill the module exactly, and reading through
short-lived mappings, so that host memory peaks near the weights' size whether the checkpoint is one file or shards.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_CHUNK_BYTES = 16 * 2**20  # file pages resident at once while reading: the peak above the weights


@dataclass(frozen=True)
class Target:
    """Where one hub tensor goes in our module."""

    name: str  # our parameter (or persistent buffer) name, e.g. "layers.0.attn.wqkv.weight"
    offset: int = 0  # first index along dim 0 of our tensor that this hub tensor fills (fused q/k/v, gate/up)


@dataclass(frozen=True)
class _Entry:
    """One hub tensor as its shard's header describes it (nothing read yet)."""

    hub_name: str
    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    target: Target


def load_checkpoint(module: nn.Module, folder: str | Path, rename: Callable[[str], Target | None], *,
                    dtype: torch.dtype | None = None, device=None, device_map=None) -> nn.Module:
    """Fill ``module`` (built under ``accelerate.init_empty_weights()`` or ``torch.device("meta")``, parameters on
    meta) from the folder's ``model.safetensors`` or the shards named in ``model.safetensors.index.json``, tensor by
    tensor: host memory peaks at the loaded weights plus one chunk of ``_CHUNK_BYTES``.

    rename: hub tensor name -> Target, or None for a tensor deliberately ignored; KeyError for an unknown one.
    dtype: of every loaded tensor; None keeps each hub tensor's own (a bf16 checkpoint stays bf16).
    device: where every tensor goes (default CPU); or device_map: accelerate's map of module names to devices,
    or "auto" (``infer_auto_device_map`` over the visible devices), then ``dispatch_model``.
    Tied tensors (an output layer sharing the embedding) are filled once and stay tied; tie them after
    ``init_empty_weights()`` exits (inside it accelerate re-wraps every registered parameter, which unties them).
    Afterwards each submodule with an ``init_buffers(device)`` method computes its non-persistent buffers.
    Refuses (ValueError) unknown hub tensors, tensors that do not fit their target, and parts of the module
    the checkpoint leaves unfilled, naming them, before any weight is read.
    """
    folder = Path(folder)
    if device is not None and device_map is not None:
        raise ValueError("pass device= or device_map=, not both")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    entries = _plan(module, folder, rename)
    slots = _slots(module)
    _check_coverage(module, entries, slots, folder)
    placement = _placement(module, entries, dtype, device, device_map)
    _read(module, folder, entries, slots, dtype, placement)
    _init_buffers(module, placement)
    leftover = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"{type(module).__name__}: still on the meta device after loading {folder} (neither in "
                         f"the checkpoint nor computed by an init_buffers method): {leftover}")
    if isinstance(placement, dict):
        from accelerate import dispatch_model

        dispatch_model(module, placement)
    return module


def load_saved(build: Callable[[], nn.Module], folder: str | Path, *, dtype: torch.dtype | None = None,
               device=None) -> nn.Module:
    """A module saved by this project's ``save_pretrained`` (its own state-dict names; a tied tensor stored once):
    ``build()`` run on the meta device (no random weights made first; ties kept, unlike ``init_empty_weights``),
    then filled by ``load_checkpoint``. dtype None keeps the saved dtype; device None is CPU.
    ValueError "<file> does not match its config: missing [...], unexpected [...]" before any weight is read."""
    folder = Path(folder)
    with torch.device("meta"):
        module = build()
    _check_names(module, folder)
    return load_checkpoint(module, folder, Target, dtype=dtype, device=device)


def _check_names(module: nn.Module, folder: Path) -> None:
    """The files hold exactly the module's state-dict names, each tied tensor under its first name."""
    from safetensors import safe_open

    files, stored = checkpoint_files(folder), set()
    for file in files:
        with safe_open(folder / file, framework="pt") as mapped:
            stored.update(mapped.keys())
    wanted = set(_tied(_slots(module)).values())
    missing, unexpected = sorted(wanted - stored), sorted(stored - wanted)
    if missing or unexpected:
        where = folder / files[0] if len(files) == 1 else folder
        raise ValueError(f"{where} does not match its config: missing {missing}, unexpected {unexpected}")


def checkpoint_files(folder: Path) -> list[str]:
    """The safetensors files of a checkpoint folder: the shards its index names, or ``model.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: {INDEX_FILE} names shards that are not there: {missing}")
        return shards
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                            f"checkpoints are read; convert a .bin one with transformers' save_pretrained)")


def _plan(module: nn.Module, folder: Path, rename) -> list[_Entry]:
    """Every hub tensor with its target, from the shard headers alone (safe_open reads no data here)."""
    from safetensors import safe_open

    entries, unknown = [], []
    for shard in checkpoint_files(folder):
        with safe_open(folder / shard, framework="pt") as file:
            for name in file.keys():
                try:
                    target = rename(name)
                except KeyError:
                    unknown.append(name)
                    continue
                if target is not None:
                    view = file.get_slice(name)
                    kind = view.get_dtype()
                    if kind not in _DTYPES:
                        raise ValueError(f"{folder}: hub tensor {name!r} in {shard} has safetensors dtype {kind}, "
                                         f"which is not read (allowed: {sorted(_DTYPES)})")
                    entries.append(_Entry(name, shard, tuple(view.get_shape()), _DTYPES[kind], target))
    if unknown:
        raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {type(module).__name__} does not know "
                         f"(a different architecture or variant?): {_few(unknown)}")
    return entries


def _slots(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: parameters and persistent buffers by state_dict name (tied aliases included)."""
    slots = dict(module.named_parameters(remove_duplicate=False))
    slots.update(module.state_dict(keep_vars=True))  # adds persistent buffers
    return slots


def _tied(slots: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each name -> the first name holding the same tensor (an output layer tied to the embedding)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name) for name, tensor in slots.items()}


def _check_coverage(module: nn.Module, entries: list[_Entry], slots: dict, folder: Path) -> None:
    """Each target exists and fits; each tensor's rows along dim 0 are filled exactly once."""
    canonical = _tied(slots)
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for e in entries:
        slot = slots.get(e.target.name)
        if slot is None:
            raise ValueError(f"rename maps hub tensor {e.hub_name!r} to {e.target.name!r}, which "
                             f"{type(module).__name__} does not have")
        rows = e.shape[0] if e.shape else 1
        if slot.dim() == 0:
            fits = e.shape == () and e.target.offset == 0
        else:
            fits = (len(e.shape) == slot.dim() and e.shape[1:] == tuple(slot.shape[1:])
                    and 0 <= e.target.offset and e.target.offset + rows <= slot.shape[0])
        if not fits:
            raise ValueError(f"{folder}: hub tensor {e.hub_name!r} of shape {list(e.shape)} does not fit "
                             f"{e.target.name!r} of shape {list(slot.shape)} at offset {e.target.offset}")
        spans.setdefault(canonical[e.target.name], []).append((e.target.offset, e.target.offset + rows, e.hub_name))
    missing = []
    for name in dict.fromkeys(canonical.values()):
        slot = slots[name]
        if name not in spans:
            if isinstance(slot, nn.Parameter):
                missing.append(name)
            continue  # a persistent buffer may be computed by init_buffers; checked after loading
        end = 0
        for start, stop, hub_name in sorted(spans[name]):
            if start != end:
                what = f"rows {start}..{end} filled twice" if start < end else f"rows {end}..{start} unfilled"
                raise ValueError(f"{folder}: {name!r} has {what} (next to {hub_name!r})")
            end = stop
        total = slot.shape[0] if slot.dim() else 1
        if end != total:
            raise ValueError(f"{folder}: {name!r} is filled up to row {end} of {total}")
    if missing:
        raise ValueError(f"{folder} lacks tensors for {len(missing)} parameter(s) of {type(module).__name__}: "
                         f"{_few(missing)}")


def _placement(module: nn.Module, entries: list[_Entry], dtype, device, device_map):
    """A device for everything (torch.device), or accelerate's device map (dict of module name -> device)."""
    if device_map is None:
        return torch.device(device if device is not None else "cpu")
    if device_map == "auto":
        from accelerate import infer_auto_device_map

        main = dtype or Counter(e.dtype for e in entries).most_common(1)[0][0]  # sizes as they will be loaded
        device_map = infer_auto_device_map(module, dtype=main,
                                           no_split_module_classes=getattr(module, "_no_split_modules", None))
    if not isinstance(device_map, dict):
        raise TypeError(f"device_map must be None, 'auto' or a dict of module names to devices, got {device_map!r}")
    if "disk" in device_map.values():  # accelerate's offload needs weights on disk in its own format
        raise ValueError("device_map places modules on 'disk' (the model does not fit the visible devices and "
                         "host memory); disk offload is not supported: free memory or use more devices")
    return dict(device_map)


def _device_of(name: str, placement) -> torch.device:
    """The device of a tensor or module name: its longest prefix in the device map."""
    if isinstance(placement, torch.device):
        return placement
    parts = name.split(".") if name else []
    for cut in range(len(parts), -1, -1):
        key = ".".join(parts[:cut])
        if key in placement:
            value = placement[key]
            return torch.device(f"cuda:{value}" if isinstance(value, int) else value)
    raise ValueError(f"device_map places no prefix of {name!r}; give it a device (or use device_map='auto')")


def _dtypes(entries: list[_Entry], dtype, folder: Path) -> dict[str, torch.dtype]:
    """The dtype of each target: ``dtype`` for floating tensors, else the hub's; fused parts must agree."""
    chosen: dict[str, torch.dtype] = {}
    for e in entries:
        want = dtype if dtype is not None and e.dtype.is_floating_point else e.dtype
        if chosen.setdefault(e.target.name, want) != want:
            raise ValueError(f"{folder}: the parts of {e.target.name!r} have different dtypes "
                             f"({chosen[e.target.name]}, {want}); pass dtype=")
    return chosen


def _read(module: nn.Module, folder: Path, entries: list[_Entry], slots: dict, dtype, placement) -> None:
    """Tensor by tensor: allocate each target once on its device, in its dtype, and copy hub tensors in by chunks."""
    from accelerate.utils import set_module_tensor_to_device

    canonical, dtypes = _tied(slots), _dtypes(entries, dtype, folder)
    for e in entries:
        name = canonical[e.target.name]
        if _get(module, name).is_meta:
            device = _device_of(name, placement)
            empty = torch.empty(slots[name].shape, dtype=dtypes[e.target.name], device=device)
            # dtype= is needed: without it accelerate casts the value to the meta tensor's float32
            set_module_tensor_to_device(module, name, device, value=empty, dtype=empty.dtype, clear_cache=False)
        live = _get(module, name)
        with torch.no_grad():
            for start, stop in _chunks(e):
                _copy_rows(live, folder / e.shard, e, start, stop)
    for alias, name in canonical.items():  # re-tie: set_module_tensor_to_device replaced one name only
        if alias != name:
            owner, _, leaf = alias.rpartition(".")
            parent = module.get_submodule(owner)
            (parent._parameters if leaf in parent._parameters else parent._buffers)[leaf] = _get(module, name)


def _chunks(e: _Entry) -> list[tuple[int, int]]:
    """Row ranges of a hub tensor, each at most ``_CHUNK_BYTES`` (or one row); one range for a scalar."""
    if not e.shape:
        return [(0, 1)]
    row_bytes = math.prod(e.shape[1:]) * e.dtype.itemsize
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    return [(start, min(start + step, e.shape[0])) for start in range(0, e.shape[0], step)]


def _copy_rows(live: torch.Tensor, file: Path, e: _Entry, start: int, stop: int) -> None:
    """Copy rows start..stop of hub tensor ``e`` into ``live`` at its target offset, through a mapping of ``file``
    opened for these rows alone: the file pages a mapping has read stay in this process's resident memory until
    it is closed, so one mapping held over a whole single-file checkpoint would hold the weights twice."""
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as mapped:
        if not e.shape:
            live.copy_(mapped.get_tensor(e.hub_name))
            return
        offset = e.target.offset
        live[offset + start:offset + stop].copy_(mapped.get_slice(e.hub_name)[start:stop])  # a view of the map


def _get(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _init_buffers(module: nn.Module, placement) -> None:
    """Computed buffers (rotary tables): each submodule with ``init_buffers(device)`` makes its own."""
    for name, sub in module.named_modules():
        init = getattr(sub, "init_buffers", None)
        if callable(init):
            init(_device_of(name, placement))


def _few(names: list[str], limit: int = 8) -> str:
    """A list of names for a message, cut after ``limit``."""
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(repr, names[:limit])) + more


# safetensors header dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
