"""Compile every Triton kernel variant the samplers can launch for a GPU architecture, without a GPU.

    python -m dllm.kernels.compile_check                       # sm_90 (H100 / H200), prints a table
    python -m dllm.kernels.compile_check --arch 80 --output compile.json

The Triton interpreter that runs the kernel tests on a CPU accepts programs the GPU compiler rejects
(and the other way round), so CPU-only CI would not notice a kernel that no longer builds. This script
calls the public wrappers (``sample_confidence_triton``, ``verify_logits_triton``) with small CPU tensors
over every switch that picks a variant (logit dtype, tile width, window width, temperature 0 or not,
given or counter noise, point-mass drafts), records each launch instead of running it (with the
16-divisibility hints Triton's launcher would derive), and compiles the recorded launches for
``sm_<arch>`` with Triton's own compiler and the ``ptxas`` it ships. Per variant it reports the
registers per thread, spilled bytes and shared memory, which decide occupancy on the real device.

Must run in a process where ``TRITON_INTERPRET`` is unset (kernels defined in interpreter mode cannot
be compiled); ``main`` re-executes itself in a clean subprocess when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
                  torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8"}


@dataclass(frozen=True)
class Variant:
    """One recorded launch: which kernel, its argument types and compile-time constants."""

    kernel: str
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type) in order; "constexpr" for constants
    constants: tuple[tuple[str, object], ...]
    num_warps: int
    divisible: tuple[int, ...] = ()  # parameters Triton's launcher marks 16-divisible (aligned pointers, ints)

    @property
    def label(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in self.constants)
        floats = sorted({t[1:] for _, t in self.signature if t in ("*bf16", "*fp16", "*fp32")})
        return f"{self.kernel}[{consts}] logits={'+'.join(floats) or '-'} warps={self.num_warps}"


@dataclass(frozen=True)
class Compiled:
    variant: str
    registers: int | None
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    shared_bytes: int
    error: str | None = None


def record_variants() -> list[Variant]:
    """Every distinct launch the wrappers make over the switches that select kernel variants."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("record_variants needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled")
    from . import sampling_triton, verify_triton

    kernels = [getattr(module, name) for module in (sampling_triton, verify_triton) for name in dir(module)
               if type(getattr(module, name)).__name__ == "JITFunction" and hasattr(getattr(module, name), "run")
               and getattr(module, name).__module__ == module.__name__]
    seen: dict[Variant, None] = {}

    def recorder(fn):
        def run(*args, grid, warmup, **kwargs):
            seen.setdefault(_variant(fn, args, kwargs), None)

        return run

    originals = {fn: fn.run for fn in kernels}
    try:
        for fn in kernels:
            fn.run = recorder(fn)
        _exercise(sampling_triton.sample_confidence_triton, verify_triton.verify_logits_triton)
    finally:
        for fn, run in originals.items():
            fn.run = run
    return list(seen)


def _exercise(sample_confidence, verify_logits) -> None:
    """Call the wrappers on small CPU tensors with every variant-selecting option: bf16 and float32
    logits (HF models give bf16, the project's transformer float32), vocabularies that pick the full
    2048-column tile (LLaDA-size) and a 512 one (the shipped models' 495 tokens), windows of 3 and 8
    drafts, temperature 0 or not, counter or given noise, point-mass drafts."""
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (4096, 495):
            logits = torch.randn(3, vocab).to(dtype)
            for temperature in (0.0, 1.0):
                sample_confidence(logits, temperature, seed=1)
                if temperature:
                    sample_confidence(logits, temperature, gumbels=torch.zeros(3, vocab, dtype=torch.float64))
            for width in (3, 8):
                drafts = torch.zeros(2, width, dtype=torch.long)
                target = torch.randn(2, width + 1, vocab).to(dtype)
                for draft_logits in (torch.randn(2, width, vocab).to(dtype), None):
                    for temperature in (0.0, 0.7):
                        verify_logits(drafts, draft_logits, target, temperature=temperature, seed=1)
                        if temperature:
                            verify_logits(drafts, draft_logits, target, temperature=temperature,
                                          uniforms=torch.rand(2, width, dtype=torch.float64),
                                          gumbels=torch.zeros(2, vocab, dtype=torch.float64))


def _variant(fn, args: tuple, kwargs: dict) -> Variant:
    names = list(fn.arg_names)
    constexpr = {names[i] for i in fn.constexprs}
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constants, divisible = [], [], []
    for index, name in enumerate(names):
        value = values[name]
        if name in constexpr:
            signature.append((name, "constexpr"))
            constants.append((name, value))
            continue
        signature.append((name, _type_of(name, value)))
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
        if aligned:  # what the launcher's specialisation would tell the compiler
            divisible.append(index)
    return Variant(fn.__name__, tuple(signature), tuple(constants), int(kwargs.get("num_warps", 4)),
                   tuple(divisible))


def _type_of(name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER_TYPES:
            raise TypeError(f"argument {name}: no Triton pointer type for {value.dtype}")
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__}")


def compile_variant(variant: Variant, arch: int) -> Compiled:
    """Compile one variant for sm_<arch> and read ptxas's resource report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import sampling_triton, verify_triton

    fn = getattr(sampling_triton, variant.kernel, None) or getattr(verify_triton, variant.kernel)
    attrs = {(index,): [["tt.divisibility", 16]] for index in variant.divisible}
    source = ASTSource(fn, dict(variant.signature), constexprs=dict(variant.constants), attrs=attrs)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": variant.num_warps})
    except Exception as error:  # report every failing variant, not only the first
        return Compiled(variant.label, None, None, None, 0, f"{type(error).__name__}: {error}"[:2000])
    registers, stores, loads = _ptxas_resources(kernel.asm["ptx"], arch)
    return Compiled(variant.label, registers, stores, loads, int(kernel.metadata.shared))


def _ptxas_resources(ptx: str, arch: int) -> tuple[int | None, int | None, int | None]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v``; None where no ptxas can read it."""
    from triton.backends.nvidia import compiler as nvidia

    binary = Path(nvidia.__file__).parent / "bin"
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        for ptxas in sorted(binary.glob("ptxas*"), key=lambda p: p.name != "ptxas"):  # plain ptxas first
            run = subprocess.run([str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", str(source), "-o",
                                  str(Path(folder) / "kernel.cubin")], capture_output=True, text=True)
            if run.returncode == 0:  # the plain one may be too old for the PTX version Triton writes
                text = run.stdout + run.stderr
                registers = re.search(r"Used (\d+) registers", text)
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
                return (int(registers.group(1)) if registers else None,
                        int(spills.group(1)) if spills else None, int(spills.group(2)) if spills else None)
    return None, None, None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 80: A100)")
    parser.add_argument("--output", help="write the report as JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):  # kernels would be defined as interpreted functions: start clean
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        command = [sys.executable, "-m", "dllm.kernels.compile_check", *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.run(command, env=env).returncode)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    report = [asdict(compile_variant(variant, args.arch)) for variant in record_variants()]
    for row in report:
        status = "FAILED " + row["error"].splitlines()[0] if row["error"] else (
            f"{row['registers']} regs, spills {row['spill_store_bytes']}/{row['spill_load_bytes']} B, "
            f"shared {row['shared_bytes']} B")
        print(f"sm_{args.arch}  {row['variant']}: {status}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    failed = [row for row in report if row["error"]]
    print(f"{len(report) - len(failed)}/{len(report)} variants compiled for sm_{args.arch}")
    if failed:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
