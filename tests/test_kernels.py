"""Kernels against their torch references under shared noise, and the references against the rule.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before any
kernel module is imported) at tiny shapes with small tiles, so every online merge across tiles is
exercised; with CUDA the same tests run at LLaDA's vocabulary size. Kernel tests skip when Triton is not
installed; the reference tests always run.
"""

import importlib.util
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from dllm.kernels import (
    sample_confidence,
    sample_confidence_reference,
    verify_logits,
    verify_logits_reference,
    verify_probs,
)
from dllm.kernels.noise import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    counter_gumbels,
    counter_uniforms,
    philox4x32,
)
from dllm.numerics import gumbel, softmax
from dllm.samplers import verify

from stat_tools import ALPHA
from triton_support import KERNELS_RUN, SKIP_REASON, triton_version

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is defined, i.e. on first import
HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if CUDA else "cpu"
# Interpreter: a few tiles per row, in chunks of one or two tiles. CUDA: LLaDA's vocabulary, default tiles.
VOCAB, BLOCK, SPLITS = (126464, None, None) if CUDA else (200, 32, 4)
TILING = dict(block_size=BLOCK, splits=SPLITS)
BATCH, WIDTH = 4, 3

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from dllm.kernels.triton_common import uniform53

    @triton.jit
    def _uniforms_kernel(out_ptr, seed, stream, columns, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * columns + offsets, uniform53(seed, stream, row, offsets), mask=offsets < columns)


needs_triton = pytest.mark.skipif(not KERNELS_RUN, reason=SKIP_REASON)
# The interpreter evaluates log(0) = -inf (a zero weight, by design) through numpy, which warns.
interpreter_log_zero = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def gumbel_noise(shape, seed):
    return gumbel(gen(seed), shape, "cpu")


def random_logits(shape, seed, minus_inf=0.2):
    """Logits with some -inf entries (never a whole row: token 0 stays finite)."""
    g = gen(seed)
    logits = 2 * torch.randn(shape, generator=g)
    logits[torch.rand(shape, generator=g) < minus_inf] = -math.inf
    logits[..., 0] = 0.0
    return logits


def verify_case(seed, batch=BATCH, width=WIDTH, vocab=VOCAB):
    """Drafts from a proposal close to the target (so some are accepted, some rejected); ragged rows."""
    g = gen(seed)
    target_logits = random_logits((batch, width + 1, vocab), seed)
    draft_logits = target_logits[:, :width].clamp(min=-30) + torch.randn(batch, width, vocab, generator=g)
    draft_tokens = (draft_logits.double() + gumbel_noise(draft_logits.shape, seed + 1)).argmax(-1)
    num_drafts = torch.tensor([width, 0, 1, width - 1] * batch)[:batch]
    has_bonus = torch.tensor([True, True, False, True] * batch)[:batch]
    return draft_tokens, draft_logits, target_logits, num_drafts, has_bonus


def assert_same_result(actual, expected):
    assert torch.equal(actual.tokens.cpu(), expected.tokens.cpu())
    assert torch.equal(actual.num_accepted.cpu(), expected.num_accepted.cpu())
    assert torch.equal(actual.num_emitted.cpu(), expected.num_emitted.cpu())


def assert_same_confidence(actual, expected):
    assert torch.equal(actual.tokens.cpu(), expected.tokens.cpu())
    for name in ("token_prob", "top1_prob", "margin", "entropy"):
        torch.testing.assert_close(getattr(actual, name).cpu(), getattr(expected, name).cpu(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counter,key,expected",
    [  # Random123's known-answer vectors for Philox-4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32(key[0] | key[1] << 32, *(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in words) == expected


def test_counter_uniforms_are_float64_grid_values_and_streams_differ():
    rows = torch.arange(64)
    u = counter_uniforms(7, STREAM_SAMPLE, rows, 1000)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u * 2.0**53, (u * 2.0**53).round())  # on the 2^-53 grid, not float32's 2^-24
    assert bool(((u * 2.0**24) != (u * 2.0**24).round()).any())
    assert not torch.equal(u, counter_uniforms(7, STREAM_RESIDUAL, rows, 1000))
    assert not torch.equal(u, counter_uniforms(8, STREAM_SAMPLE, rows, 1000))
    assert torch.equal(u[5:9], counter_uniforms(7, STREAM_SAMPLE, rows[5:9], 1000))  # rows replay alone
    assert scipy_stats.kstest(u.flatten().numpy(), "uniform").pvalue > ALPHA


# ---------------------------------------------------------------------------------------------------
# References: the logits path is the probability rule applied to softmax(logits / T)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_verify_logits_reference_is_verify_on_softmax(temperature, point_mass):
    drafts, draft_logits, target_logits, num_drafts, has_bonus = verify_case(3, batch=16, vocab=50)
    draft_logits = None if point_mass else draft_logits
    greedy = temperature == 0
    draft_probs = None if point_mass or greedy else softmax(draft_logits, temperature)
    target = target_logits if greedy else softmax(target_logits, temperature)
    common = dict(has_bonus=has_bonus)
    # The same generator: the logits path draws the same noise in the same order.
    expected = verify(drafts, draft_probs, target, num_drafts, **common, greedy=greedy, generator=gen(9))
    actual = verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, **common,
                                     temperature=temperature, generator=gen(9))
    assert_same_result(actual, expected)
    # The same explicit noise.
    noise = dict(uniforms=torch.rand(drafts.shape, generator=gen(4), dtype=torch.float64),
                 gumbels=gumbel_noise((16, 50), 5))
    expected = verify(drafts, draft_probs, target, num_drafts, **common, greedy=greedy, **noise)
    actual = verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, **common,
                                     temperature=temperature, **noise)
    assert_same_result(actual, expected)
    if not greedy:  # the case exercises acceptances, rejections and corrections
        assert 0 < int(expected.num_accepted.sum()) < int(num_drafts.sum())


def test_verify_logits_reference_seed_is_counter_noise():
    drafts, draft_logits, target_logits, num_drafts, has_bonus = verify_case(6, batch=16, vocab=50)
    rows = torch.arange(16)
    expected = verify_probs(drafts, softmax(draft_logits, 0.9), softmax(target_logits, 0.9), num_drafts,
                            has_bonus=has_bonus, uniforms=counter_uniforms(11, STREAM_ACCEPT, rows, WIDTH),
                            gumbels=counter_gumbels(11, STREAM_RESIDUAL, rows, 50))
    actual = verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, has_bonus=has_bonus,
                                     temperature=0.9, seed=11)
    assert_same_result(actual, expected)


def test_seeded_verification_emits_the_target_law():
    """Counter noise is valid sampling noise: the first emitted token is distributed as the target."""
    n = 8000
    target_row = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    draft_row = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    drafts = torch.multinomial(draft_row, n, replacement=True, generator=gen(1))[:, None]
    out = verify_logits_reference(drafts, draft_row.log().expand(n, 1, 5), target_row.log().expand(n, 2, 5),
                                  temperature=1.0, seed=2024)
    counts = torch.bincount(out.tokens[:, 0], minlength=5)
    assert counts[4] == 0
    assert scipy_stats.chisquare(counts[:4].numpy(), (target_row[:4] * n).numpy()).pvalue > ALPHA


def test_sample_confidence_reference_noise_options():
    logits = random_logits((6, 40), 0)
    noise = gumbel_noise((6, 40), 1)
    by_generator = sample_confidence_reference(logits, 0.7, gen(1))  # the generator path draws the same noise
    by_noise = sample_confidence_reference(logits, 0.7, gumbels=noise)
    assert torch.equal(by_generator.tokens, by_noise.tokens)
    assert torch.equal(by_noise.tokens, (logits / 0.7).double().add(noise).argmax(-1))
    by_seed = sample_confidence_reference(logits, 0.7, seed=3)
    counter_noise = counter_gumbels(3, STREAM_SAMPLE, torch.arange(6), 40)
    by_counter = sample_confidence_reference(logits, 0.7, gumbels=counter_noise)
    assert torch.equal(by_seed.tokens, by_counter.tokens)
    assert torch.equal(sample_confidence_reference(logits, 0.0).tokens, logits.argmax(-1))


def test_dispatchers_use_the_reference_on_cpu():
    drafts, draft_logits, target_logits, num_drafts, has_bonus = verify_case(2, vocab=30)
    kwargs = dict(has_bonus=has_bonus, temperature=1.0, seed=5)
    assert_same_result(verify_logits(drafts, draft_logits, target_logits, num_drafts, **kwargs),
                       verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, **kwargs))
    logits = random_logits((5, 30), 1)
    assert_same_confidence(sample_confidence(logits, 0.5, gen(2)), sample_confidence_reference(logits, 0.5, gen(2)))


# ---------------------------------------------------------------------------------------------------
# Triton kernels against the references (interpreter on the CPU, compiled on CUDA)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_kernels():
    if not KERNELS_RUN:
        pytest.skip(SKIP_REASON)
    from dllm.kernels import sampling_triton, verify_triton

    if not CUDA and type(verify_triton._emit_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton kernels were compiled before TRITON_INTERPRET=1 was set; run this file alone")
    return verify_triton.verify_logits_triton, sampling_triton.sample_confidence_triton


def to_device(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


@needs_triton
def test_triton_counter_noise_matches_torch():
    for seed in (0, 12345, (1 << 62) + 3):  # 32- and 64-bit seeds take different argument types
        out = torch.empty((3, 50), dtype=torch.float64, device=DEVICE)
        _uniforms_kernel[(3,)](out, seed, STREAM_RESIDUAL, 50, BLOCK=64)
        assert torch.equal(out.cpu(), counter_uniforms(seed, STREAM_RESIDUAL, torch.arange(3), 50))


@interpreter_log_zero
@pytest.mark.parametrize("noise", ["given", "seed"])
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_kernel_matches_reference(triton_kernels, temperature, point_mass, noise):
    verify_logits_triton, _ = triton_kernels
    drafts, draft_logits, target_logits, num_drafts, has_bonus = verify_case(10)
    if point_mass:  # n-gram style proposals: the target's argmax for half the rows, so some are accepted
        drafts[::2] = target_logits[::2, :WIDTH].argmax(-1)
        draft_logits = None
    if temperature == 0:  # greedy: rows 0 and 3 draft the argmax until their last draft
        drafts[[0, 3]] = target_logits[[0, 3], :WIDTH].argmax(-1)
        drafts[0, -1] = (drafts[0, -1] + 1) % VOCAB
        # Ties across tiles go to the lowest index: row 1's bonus is token 5, row 2's draft is rejected.
        target_logits[1, 0, [5, VOCAB - 1]] = 50.0
        target_logits[2, 0, [2, VOCAB - 3]] = 50.0
        drafts[2, 0] = VOCAB - 3
    if noise == "given":
        kwargs = dict(uniforms=torch.rand(drafts.shape, generator=gen(1), dtype=torch.float64).to(DEVICE),
                      gumbels=gumbel_noise((BATCH, VOCAB), 2).to(DEVICE))
    else:
        kwargs = dict(seed=77)
    kwargs.update(temperature=temperature, has_bonus=has_bonus.to(DEVICE))
    args = to_device(drafts, draft_logits, target_logits, num_drafts)
    expected = verify_logits_reference(*args, **kwargs)
    assert_same_result(verify_logits_triton(*args, **kwargs, **TILING), expected)
    assert int(expected.num_accepted.sum()) > 0
    if temperature == 0:
        assert expected.tokens[1, 0] == 5 and expected.tokens[2, 0] == 2


@interpreter_log_zero
def test_verify_kernel_edge_rows(triton_kernels):
    """K target rows (no bonus row), a bf16 input, and a zero-mass residual (target == draft, draft
    probability 0 at the drafted token), which falls back to sampling the target."""
    verify_logits_triton, _ = triton_kernels
    drafts, draft_logits, target_logits, num_drafts, _ = verify_case(20)
    no_bonus = dict(temperature=0.9, seed=3)
    args = to_device(drafts, draft_logits, target_logits[:, :WIDTH], num_drafts)
    assert_same_result(verify_logits_triton(*args, **no_bonus, **TILING),
                       verify_logits_reference(*args, **no_bonus))

    bf16 = to_device(drafts, draft_logits.bfloat16(), target_logits.bfloat16(), num_drafts)
    assert_same_result(verify_logits_triton(*bf16, temperature=1.0, seed=4, **TILING),
                       verify_logits_reference(*bf16, temperature=1.0, seed=4))

    target_logits[:, :, 7] = -math.inf
    drafts[:, 0] = 7
    same = to_device(drafts, target_logits[:, :WIDTH], target_logits, num_drafts.clamp(min=1))
    expected = verify_logits_reference(*same, temperature=1.0, seed=5)
    assert int(expected.num_accepted.sum()) == 0 and bool((expected.tokens[:, 0] != 7).all())
    assert_same_result(verify_logits_triton(*same, temperature=1.0, seed=5, **TILING), expected)


@interpreter_log_zero
@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), width=st.integers(0, 3), vocab=st.integers(2, 70), splits=st.integers(1, 3),
       seed=st.integers(0, 1000), bonus=st.booleans(), point_mass=st.booleans(), greedy=st.booleans())
def test_verify_kernel_properties(triton_kernels, batch, width, vocab, splits, seed, bonus, point_mass, greedy):
    """Random shapes, including no drafts at all (K = 0) and no bonus row."""
    verify_logits_triton, _ = triton_kernels
    g = gen(seed)
    target_logits = random_logits((batch, width + int(bonus), vocab), seed, minus_inf=0.3)
    draft_logits = None if point_mass else random_logits((batch, width, vocab), seed + 1)
    drafts = torch.randint(0, vocab, (batch, width), generator=g)
    num_drafts = torch.randint(0, width + 1, (batch,), generator=g)
    args = to_device(drafts, draft_logits, target_logits, num_drafts)
    kwargs = dict(temperature=0.0 if greedy else 1.0, seed=seed)
    assert_same_result(verify_logits_triton(*args, **kwargs, block_size=16, splits=splits),
                       verify_logits_reference(*args, **kwargs))


def confidence_logits():
    """Rows with -inf entries, a tie for the top logit across tiles and within a tile, one finite entry."""
    logits = random_logits((5, VOCAB), 30)
    logits[1, [3, VOCAB - 2]] = 9.0  # tie across tiles
    logits[2, [5, 6]] = 9.0  # tie within a tile
    logits[3, 1:] = -math.inf  # a single finite logit: entropy 0, margin 1
    logits[4, : VOCAB // 2] = -math.inf  # leading tiles entirely -inf
    logits[4, -1] = 0.5
    return logits


@interpreter_log_zero
@pytest.mark.parametrize("noise", ["given", "seed"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sample_confidence_kernel_matches_reference(triton_kernels, temperature, noise):
    _, sample_confidence_triton = triton_kernels
    if temperature == 0 and noise == "seed":
        pytest.skip("greedy draws no noise")
    logits = confidence_logits().to(DEVICE)
    kwargs = dict(gumbels=gumbel_noise(logits.shape, 3).to(DEVICE)) if noise == "given" else dict(seed=99)
    expected = sample_confidence_reference(logits, temperature, **kwargs)
    assert_same_confidence(sample_confidence_triton(logits, temperature, **kwargs, **TILING), expected)
    assert expected.margin[1] == 0 and expected.margin[2] == 0 and expected.entropy[3] == 0


@interpreter_log_zero
def test_sample_confidence_kernel_bf16(triton_kernels):
    _, sample_confidence_triton = triton_kernels
    logits = confidence_logits().bfloat16().to(DEVICE)
    assert_same_confidence(sample_confidence_triton(logits, 0.9, seed=1, **TILING),
                           sample_confidence_reference(logits, 0.9, seed=1))


@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="dispatch to Triton needs CUDA tensors")
def test_dispatchers_use_the_kernels_on_cuda(triton_kernels):
    verify_logits_triton, sample_confidence_triton = triton_kernels
    drafts, draft_logits, target_logits, num_drafts, has_bonus = to_device(*verify_case(2))
    kwargs = dict(has_bonus=has_bonus, temperature=1.0)
    assert_same_result(verify_logits(drafts, draft_logits, target_logits, num_drafts, **kwargs, seed=1),
                       verify_logits_triton(drafts, draft_logits, target_logits, num_drafts, **kwargs, seed=1))
    logits = confidence_logits().to(DEVICE)
    assert_same_confidence(sample_confidence(logits, 0.5, seed=2), sample_confidence_triton(logits, 0.5, seed=2))


@interpreter_log_zero
@pytest.mark.skipif(CUDA, reason="on CUDA run the benchmark itself: python -m dllm.kernels.bench")
@pytest.mark.skipif(HAVE_TRITON and not KERNELS_RUN, reason=SKIP_REASON)
def test_bench_smoke(tmp_path):
    from dllm.kernels import bench

    bench.main(["--smoke", "--output", str(tmp_path / "smoke.json")])
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert len(report["cases"]) == len(bench.SMOKE_CASES)
    assert report["complete"] and not any(case.get("error") for case in report["cases"])
    if HAVE_TRITON:
        assert all(case["tokens_match"] for case in report["cases"])


@pytest.mark.slow  # about 40 s: 90 variants through Triton's compiler and ptxas
@pytest.mark.skipif(not HAVE_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton with its NVIDIA backend")
def test_every_kernel_variant_compiles_for_hopper_without_spills(tmp_path):
    """The interpreter runs programs the GPU compiler may reject: compile every launched variant for sm_90."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "dllm.kernels.compile_check", "--arch", "90", "--output",
                          str(tmp_path / "compile.json")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    kernels = {row["variant"].split("[")[0] for row in report}
    assert kernels == {"_partial_kernel", "_finish_kernel", "_row_stats_kernel", "_sample_partial_kernel",
                       "_emit_kernel"}
    assert len(report) >= 80 and not any(row["error"] for row in report)
    assert {"logits=bf16", "logits=fp32"} <= {row["variant"].split("] ")[1].split(" ")[0] for row in report}
    assert all(row["registers"] is not None for row in report)  # ptxas -v read every variant
    spilling = [row["variant"] for row in report if row["spill_store_bytes"] or row["spill_load_bytes"]]
    # Measured with Triton 3.9: no spills. Triton 3.6 (the GPU image's) spills 4 B in two float32 _emit_kernel
    # variants (one program per row, after the vocabulary passes), so the guard applies from 3.9 on.
    if triton_version() >= (3, 9):
        assert not spilling
