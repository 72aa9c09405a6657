"""Benchmark of the fused Triton kernels against their torch references: a script, never a timed test.

    python -m dllm.kernels.bench --output bench.json           # CUDA: LLaDA-scale shapes, a few minutes
    python -m dllm.kernels.bench --smoke --output smoke.json   # CPU: tiny shapes, Triton interpreter

Per case: median time of kernel and reference and their ratio, bytes of logits read, achieved bandwidth
(logit bytes / time) against the device's copy bandwidth (measured here on a plain tensor copy), extra
peak memory of one call (``torch.cuda.max_memory_allocated``) against the size a [rows, V] float64 tensor
would take, and whether kernel and reference emit the same tokens under a shared seed. Goal on a GPU:
at least 3x faster than the reference, and no [rows, V] float64 intermediate. The smoke run checks only
that everything runs and matches; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

LLADA_VOCAB = 126464
GOAL_SPEEDUP = 3.0


@dataclass(frozen=True)
class Case:
    """One benchmark shape: ``rows`` positions (sample_confidence) or batch rows with ``width`` drafts."""

    kernel: str  # "sample_confidence" or "verify_logits"
    rows: int
    temperature: float
    width: int = 0
    draft_logits: bool = True  # verify_logits: False for point-mass drafts


FULL_CASES = [
    Case("sample_confidence", 64, 0.0),
    Case("sample_confidence", 64, 1.0),
    Case("sample_confidence", 256, 0.0),
    Case("sample_confidence", 256, 1.0),
    Case("verify_logits", 8, 0.0, width=4),
    Case("verify_logits", 8, 1.0, width=4),
    Case("verify_logits", 32, 0.0, width=7),  # 32 x (7 + 1) = 256 target rows
    Case("verify_logits", 32, 1.0, width=7),
    Case("verify_logits", 32, 1.0, width=7, draft_logits=False),
]
SMOKE_CASES = [
    Case("sample_confidence", 4, 0.0),
    Case("sample_confidence", 4, 1.0),
    Case("verify_logits", 3, 0.0, width=2),
    Case("verify_logits", 3, 1.0, width=2),
    Case("verify_logits", 3, 1.0, width=2, draft_logits=False),
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="path of the JSON report")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per function and case")
    parser.add_argument("--vocab", type=int, default=LLADA_VOCAB, help="vocabulary size (Gemma: 262144)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("dllm.kernels.bench: no CUDA device; the benchmark needs a GPU (use --smoke for a CPU smoke run)")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules import triton
    vocab, cases, iters = (256, SMOKE_CASES, 1) if args.smoke else (args.vocab, FULL_CASES, args.iters)
    kernels = _load_kernels()
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: timings are meaningless)",
        "torch": torch.__version__,
        "triton": kernels["version"],
        "vocab": vocab,
        "logits_dtype": "bfloat16",
        "copy_bandwidth_gb_s": _copy_bandwidth(device) / 1e9,
        "goal_speedup": GOAL_SPEEDUP,
        "complete": False,
        "cases": [],
    }
    began = time.perf_counter()
    for case in cases:
        # One case's failure (out of memory, a compile error) is recorded and the others still run; the
        # report is rewritten after every case, so an interrupted run keeps what it measured.
        try:
            result = _run_case(case, vocab, device, iters, kernels)
            achieved = result["kernel_gb_s"]
            result["bandwidth_fraction"] = None if achieved is None else achieved / report["copy_bandwidth_gb_s"]
        except Exception as error:
            result = asdict(case) | {"error": f"{type(error).__name__}: {error}"[:2000], "speedup": None}
        report["cases"].append(result)
        report["elapsed_s"] = time.perf_counter() - began
        _write(args.output, report)
        print(_summary_line(result), flush=True)
    timed = [case for case in report["cases"] if case["speedup"] is not None]
    report["all_meet_goal"] = len(timed) == len(report["cases"]) > 0 and all(
        case["speedup"] >= GOAL_SPEEDUP and case["tokens_match"] and not case["kernel_float64_rows_intermediate"]
        for case in timed
    )
    report["complete"] = True
    _write(args.output, report)
    print(json.dumps(report, indent=2))
    return report


def _write(path: str, report: dict) -> None:
    """Write the report atomically (a partial file never replaces a good one)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(temporary, path)


def _summary_line(result: dict) -> str:
    name = f"{result['kernel']} rows={result['rows']} width={result['width']} T={result['temperature']}"
    if result.get("error"):
        return f"{name}: ERROR {result['error'].splitlines()[0]}"
    if result["speedup"] is None:
        return f"{name}: reference {result['reference_s'] * 1e3:.3f} ms (no Triton)"
    return (f"{name}: kernel {result['kernel_s'] * 1e3:.3f} ms, reference {result['reference_s'] * 1e3:.3f} ms, "
            f"{result['speedup']:.2f}x, tokens match {result['tokens_match']}")


def _load_kernels() -> dict:
    """The Triton entry points, or None each where Triton is not installed (the smoke run still times the
    references)."""
    try:
        import triton

        from .sampling_triton import sample_confidence_triton
        from .verify_triton import verify_logits_triton
    except ImportError:
        return {"version": None, "sample_confidence": None, "verify_logits": None}
    return {"version": triton.__version__, "sample_confidence": sample_confidence_triton,
            "verify_logits": verify_logits_triton}


def _run_case(case: Case, vocab: int, device: torch.device, iters: int, kernels: dict) -> dict:
    """Time kernel and reference on one shape and compare their tokens under a shared seed."""
    from .sampling import sample_confidence_reference
    from .verify import verify_logits_reference

    inputs, logit_bytes = _inputs(case, vocab, device)
    reference = {"sample_confidence": sample_confidence_reference, "verify_logits": verify_logits_reference}
    reference_fn = _bind(reference[case.kernel], case, inputs)
    kernel_fn = _bind(kernels[case.kernel], case, inputs) if kernels[case.kernel] else None
    generator = torch.Generator(device=device).manual_seed(0)

    result = asdict(case) | {"logit_bytes": logit_bytes, "float64_rows_bytes": logit_bytes // 2 * 8}
    warmup = 2 if device.type == "cuda" else 0  # the interpreter compiles nothing; keep the smoke run short
    result["reference_s"] = _median_time(lambda: reference_fn(generator=generator), device, iters, warmup)
    result["reference_peak_extra_bytes"] = _peak_extra_bytes(lambda: reference_fn(generator=generator), device)
    if kernel_fn is None:
        return result | {"kernel_s": None, "kernel_gb_s": None, "speedup": None, "tokens_match": None,
                         "kernel_peak_extra_bytes": None, "kernel_float64_rows_intermediate": None}
    result["tokens_match"] = _same_tokens(kernel_fn(seed=1), reference_fn(seed=1))
    result["kernel_s"] = _median_time(lambda: kernel_fn(generator=generator), device, iters, warmup)
    result["kernel_gb_s"] = logit_bytes / result["kernel_s"] / 1e9
    result["speedup"] = result["reference_s"] / result["kernel_s"]
    peak = _peak_extra_bytes(lambda: kernel_fn(generator=generator), device)
    result["kernel_peak_extra_bytes"] = peak
    result["kernel_float64_rows_intermediate"] = None if peak is None else peak >= result["float64_rows_bytes"]
    return result


def _inputs(case: Case, vocab: int, device: torch.device) -> tuple[dict, int]:
    """Random bf16 logits for the case (drafts sampled from the draft logits) and their size in bytes."""
    g = torch.Generator(device=device).manual_seed(1234)
    if case.kernel == "sample_confidence":
        logits = torch.randn((case.rows, vocab), generator=g, device=device).mul_(3).bfloat16()
        return {"logits": logits}, logits.numel() * logits.element_size()
    target = torch.randn((case.rows, case.width + 1, vocab), generator=g, device=device).mul_(3)
    draft = target[:, : case.width] + torch.randn((case.rows, case.width, vocab), generator=g, device=device)
    drafts = torch.multinomial(torch.softmax(draft.flatten(0, 1), -1), 1, generator=g).view(case.rows, case.width)
    inputs = {"draft_tokens": drafts, "draft_logits": draft.bfloat16() if case.draft_logits else None,
              "target_logits": target.bfloat16()}
    logit_bytes = sum(t.numel() * t.element_size() for t in inputs.values() if t is not None and t.is_floating_point())
    return inputs, logit_bytes


def _bind(fn, case: Case, inputs: dict):
    """``fn`` on the case's inputs; the returned callable takes the noise (generator= or seed=)."""
    if case.kernel == "sample_confidence":
        return lambda **noise: fn(inputs["logits"], case.temperature, **noise)
    return lambda **noise: fn(inputs["draft_tokens"], inputs["draft_logits"], inputs["target_logits"],
                              temperature=case.temperature, **noise)


def _same_tokens(a, b) -> bool:
    if hasattr(a, "num_emitted") and not torch.equal(a.num_emitted, b.num_emitted):
        return False
    return bool(torch.equal(a.tokens, b.tokens))


def _median_time(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds per call, after warm-up calls (which include Triton compilation)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _peak_extra_bytes(fn, device: torch.device) -> int | None:
    """Memory one call allocates at its peak beyond what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a plain device-to-device copy (read + write), the roofline for the kernels."""
    size = (1 << 30) if device.type == "cuda" else (1 << 24)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * size / _median_time(lambda: target.copy_(source), device, iters=10)


if __name__ == "__main__":
    main()
