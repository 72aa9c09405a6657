"""Peak host memory while loading a bf16 TransformerLM checkpoint, one file or sharded: ``from_pretrained`` vs a
second copy.

Usage: ``python -m dllm.eval.study.load_memory [--layers 2] [--files single sharded] [--shard-mb 1024]``; the widths
default to LLaDA-8B's (dim 4096, MLP 12288, vocabulary 126464, untied output layer: 2.8 GiB at 2 layers).
Each way runs in a fresh subprocess and reports its resident-memory high-water mark (``VmHWM``) above its resident
size just before loading (interpreter, torch, accelerate, safetensors and torch's meta kernels already counted in
that baseline), in MiB and as a multiple of the checkpoint's bytes. ``VmHWM`` rather than ``ru_maxrss``: Linux
carries ``ru_maxrss`` over from the parent across exec, so a child would report at least the parent's peak (the
parent wrote the checkpoint).
Resident size counts the pages of a memory-mapped file the process has read, not only what it allocated: a loader
that keeps a whole file mapped while copying it into allocated parameters holds the weights twice.
Ways: ``from_pretrained`` (the project's loader) and ``load_file_copy`` (safetensors' ``load_file`` dict copied into
a module allocated in bf16 without initialisation: the second copy alone). Prints one line per way and file layout;
asserts nothing (tests/test_load_peak.py holds from_pretrained to 1.2x).
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

from dllm.models.transformer import CONFIG_NAME, WEIGHTS_NAME, TransformerConfig, TransformerLM

WAYS = ("from_pretrained", "load_file_copy")


def llada_like(layers: int, dim: int = 4096, mlp_hidden: int = 12288, vocab_size: int = 126464) -> TransformerConfig:
    """LLaDA-8B's widths (its config.json: 32 heads of 128, untied output layer) at ``layers`` layers."""
    return TransformerConfig(vocab_size=vocab_size, dim=dim, n_layers=layers, n_heads=dim // 128,
                             mlp_hidden=mlp_hidden, max_seq_len=4096, layout="bidirectional",
                             mask_token_id=vocab_size - 1, tie_embeddings=False)


def write_checkpoint(folder: Path, config: TransformerConfig, shard_mb: int | None = None) -> int:
    """Random bf16 weights of ``config`` as ``model.safetensors``, or sharded by huggingface_hub's split (as real
    checkpoints are) when ``shard_mb`` -> the weights' bytes."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {name: t.shape for name, t in TransformerLM(config).state_dict().items()}
    if config.tie_embeddings:
        del shapes["output.weight"]
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator, dtype=torch.bfloat16) for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config.to_dict()))
    if shard_mb is None:
        save_file(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    else:
        split = split_torch_state_dict_into_shards(state, max_shard_size=shard_mb * 2**20)
        for file, names in split.filename_to_tensors.items():
            save_file({k: state[k] for k in names}, folder / file, metadata={"format": "pt"})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}))
    return sum(t.nbytes for t in state.values())


def _rss_mib() -> float:
    """Resident size now (MiB), from /proc (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    """This process's resident high-water mark (MiB): VmHWM, which starts afresh at exec."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def _load_file_copy(folder: Path) -> TransformerLM:
    """The whole state dict from ``load_file``, then copied into a bf16 module allocated without initialisation."""
    from safetensors.torch import load_file

    from dllm.models.checkpoint import checkpoint_files

    state = {}
    for file in checkpoint_files(folder):
        state.update(load_file(folder / file))
    config = TransformerConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text()))
    with torch.device("meta"):
        model = TransformerLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu").load_state_dict(state, strict=not config.tie_embeddings)
    return model


def measure(way: str, folder: Path) -> dict:
    """Load ``folder`` one way in this process -> MiB above the pre-load baseline at the high-water mark."""
    import accelerate.utils  # noqa: F401  (imported by the loaders: code, counted in the baseline like torch)
    import safetensors.torch  # noqa: F401

    # The first op on a meta tensor imports torch's Python meta kernels (sympy: ~145 MiB resident, ~2 s), once per
    # process whatever the checkpoint's size: code, so it goes in the baseline too.
    torch.nn.init.normal_(torch.empty(1, device="meta"))
    weights_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    before = _rss_mib()
    model = TransformerLM.from_pretrained(folder) if way == "from_pretrained" else _load_file_copy(folder)
    above = _peak_mib() - before
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"way": way, "weights_mib": round(weights_mib, 1), "peak_above_baseline_mib": round(above, 1),
            "ratio": round(above / weights_mib, 3), "dtypes": dtypes}


def measure_in_child(way: str, folder: Path) -> dict:
    """``measure`` in a fresh interpreter, so that the high-water mark is this load's alone."""
    out = subprocess.run([sys.executable, "-m", "dllm.eval.study.load_memory", "--child", way, str(folder)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--mlp-hidden", type=int, default=12288)
    parser.add_argument("--vocab-size", type=int, default=126464)
    parser.add_argument("--files", nargs="+", choices=("single", "sharded"), default=["single", "sharded"])
    parser.add_argument("--shard-mb", type=int, default=1024, help="largest shard of the sharded layout")
    parser.add_argument("--child", nargs=2, metavar=("WAY", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], Path(args.child[1]))))
        return
    config = llada_like(args.layers, args.dim, args.mlp_hidden, args.vocab_size)
    for files in args.files:
        with tempfile.TemporaryDirectory() as tmp:
            nbytes = write_checkpoint(Path(tmp), config, args.shard_mb if files == "sharded" else None)
            count = len(list(Path(tmp).glob("*.safetensors")))
            print(f"{files} ({count} file(s), {nbytes / 2**20:.0f} MiB bf16, {args.layers} layers):")
            for way in WAYS:
                result = measure_in_child(way, Path(tmp))
                print(f"  {way}: peak host memory {result['peak_above_baseline_mib']} MiB above baseline "
                      f"({result['ratio']}x the weights), parameters {result['dtypes']}")


if __name__ == "__main__":
    main()
