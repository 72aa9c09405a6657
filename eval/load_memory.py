"""Peak host memory while loading a sharded bf16 checkpoint: ``load_checkpoint`` vs the whole state dict at once.

Usage: ``python -m eval.load_memory [--shards 4] [--shard-mb 50]``. Each way runs in a fresh subprocess and
reports its resident-memory high-water mark (``VmHWM``) above its resident size just before loading (interpreter,
torch and the meta-built module already counted in that baseline). ``VmHWM`` rather than ``ru_maxrss``: Linux
carries ``ru_maxrss`` over from the parent across exec, so a child would report at least the parent's peak
(the parent wrote the checkpoint). Prints one line per way; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

WIDTH = 2048  # one 2048 x 2048 bf16 matrix = 8 MiB


class Stack(nn.Module):
    """Square bf16 matrices, the bulk of a transformer's bytes, without its arithmetic."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n))


def write_checkpoint(folder: Path, shards: int, shard_mb: int) -> int:
    """A sharded bf16 checkpoint (huggingface_hub's split, as real ones are) -> the number of matrices."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    per_shard = max(1, shard_mb * 2**20 // (WIDTH * WIDTH * 2))
    n = shards * per_shard
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=generator).to(torch.bfloat16)
             for i in range(n)}
    split = split_torch_state_dict_into_shards(state, max_shard_size=per_shard * WIDTH * WIDTH * 2)
    for file, names in split.filename_to_tensors.items():
        save_file({k: state[k] for k in names}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}))
    return n


def _rss_mib() -> float:
    """Resident size now (MiB), from /proc (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    """This process's resident high-water mark (MiB): VmHWM, which starts afresh at exec."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def measure(way: str, folder: Path, n: int, device: str = "cpu") -> dict:
    """Load ``folder`` one way in this process -> MiB above the pre-load baseline at the high-water mark."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    from dllm.models.checkpoint import Target, checkpoint_files, load_checkpoint

    with init_empty_weights():
        model = Stack(n)
    before = _rss_mib()
    if way == "load_checkpoint":
        load_checkpoint(model, folder, Target, device=device)
    else:  # the whole state dict in memory, then copied into an allocated bf16 model
        state = {}
        for shard in checkpoint_files(folder):
            state.update(load_file(folder / shard))
        model.to_empty(device=device).to(torch.bfloat16).load_state_dict(state)
    peak = _peak_mib()
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"way": way, "peak_above_baseline_mib": round(peak - before, 1), "dtypes": dtypes}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--device", default="cpu", help="where the parameters go (host memory is measured)")
    parser.add_argument("--child", nargs=3, metavar=("WAY", "FOLDER", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        way, folder, n = args.child
        print(json.dumps(measure(way, Path(folder), int(n), args.device)))
        return
    if args.shards < 1 or args.shard_mb < 8:
        parser.error("--shards must be >= 1 and --shard-mb >= 8 (one matrix is 8 MiB)")
    with tempfile.TemporaryDirectory() as tmp:
        n = write_checkpoint(Path(tmp), args.shards, args.shard_mb)
        files = sorted(Path(tmp).glob("*.safetensors"))
        sizes = [f.stat().st_size / 2**20 for f in files]
        print(f"checkpoint (parameters to {args.device}): {len(files)} shards, {sum(sizes):.0f} MiB bf16 "
              f"(largest shard {max(sizes):.0f} MiB)")
        for way in ("load_checkpoint", "whole_state_dict"):
            out = subprocess.run([sys.executable, "-m", "eval.load_memory", "--child", way, tmp, str(n),
                                  "--device", args.device],
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{way}: peak host memory {result['peak_above_baseline_mib']} MiB above baseline, "
                  f"parameters {result['dtypes']}")


if __name__ == "__main__":
    main()
