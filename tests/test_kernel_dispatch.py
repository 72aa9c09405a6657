"""The samplers with the kernels dispatched: exact under the kernels' noise contract, and the interpreted
kernels replay that contract token for token inside real decoding loops.

A kernel turns the caller's generator into one seed (``draw_seed``) and derives every uniform and Gumbel
from (seed, row, position). ``contract`` below is that behaviour built from the torch references; the
chi-square tests run the samplers through the dispatcher with it at full sample size, and the replay
tests show, at a few rows (the interpreter runs about 10 ms per program), that the real kernels emit the
same tokens as ``contract`` in the same decoding loops. Together: the samplers are exact with the kernels.
"""

import os

import pytest
import torch

import dllm
from dllm.kernels import draw_seed, kernel_mode, sample_confidence_reference, use_kernels, verify_logits_reference
from dllm.kernels.dispatch import use_triton
from dllm.models.oracle import HMMOracle
from dllm.samplers import sequential_distribution

from stat_tools import ALPHA, chi_square_pvalue
from triton_support import KERNELS_RUN, SKIP_REASON

HAVE_TRITON = __import__("importlib").util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
PROMPT = torch.tensor([0, 2])
GEN = 4


@pytest.fixture(scope="module")
def oracle():
    return HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0)


def contract_sample_confidence(logits, temperature, generator=None, *, gumbels=None, seed=None, **tiling):
    if temperature > 0 and gumbels is None and seed is None:
        seed = draw_seed(generator)
    return sample_confidence_reference(logits, temperature, gumbels=gumbels, seed=seed)


def contract_verify_logits(draft_tokens, draft_logits, target_logits, num_drafts=None, *, temperature,
                           generator=None, uniforms=None, gumbels=None, seed=None, **rest):
    if temperature > 0 and (uniforms is None or gumbels is None) and seed is None:
        seed = draw_seed(generator)
    return verify_logits_reference(draft_tokens, draft_logits, target_logits, num_drafts, temperature=temperature,
                                   uniforms=uniforms, gumbels=gumbels, seed=seed, **rest)


@pytest.fixture
def contract(monkeypatch):
    """Dispatch to 'Triton', answered by the contract; counts the calls."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    from dllm.kernels import sampling_triton, verify_triton

    calls = {"verify": 0, "sample": 0}

    def counted(fn, key):
        def run(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(verify_triton, "verify_logits_triton", counted(contract_verify_logits, "verify"))
    monkeypatch.setattr(sampling_triton, "sample_confidence_triton", counted(contract_sample_confidence, "sample"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # mode 'triton' on CPU tensors asks for it; nothing compiles here
    with use_kernels("triton"):
        yield calls


def draw(model, sampler, n, seed, temperature=1.0, **options):
    out = dllm.generate(model, PROMPT.expand(n, -1), sampler=sampler, max_new_tokens=GEN, temperature=temperature,
                        generator=torch.Generator().manual_seed(seed), **options)
    return out.sequences[:, PROMPT.numel():]


@pytest.mark.parametrize("draft", ["marginal", "stale"])
def test_fef_exact_under_the_kernel_contract(oracle, contract, draft):
    answers = draw(oracle, "fef", 12000, seed=21, window=3, draft=draft, order="confidence")
    assert contract["verify"] > 0
    expected = sequential_distribution(oracle, PROMPT, GEN, order="confidence")
    assert chi_square_pvalue(answers, expected) > ALPHA


def test_ar_spec_exact_under_the_kernel_contract(oracle, contract):
    answers = draw(oracle.as_causal(), "ar_spec", 12000, seed=22, temperature=0.7,
                   drafter=oracle.perturbed(0.5).as_causal(), num_draft_tokens=3)
    assert contract["verify"] > 0
    expected = sequential_distribution(oracle.as_causal(), PROMPT, GEN, temperature=0.7)
    assert chi_square_pvalue(answers, expected) > ALPHA


def test_power_contract_with_a_biased_seed_fails(oracle, contract, monkeypatch):
    """The same test rejects a verifier that accepts too often (threshold 1.5x target/draft)."""
    from dllm.kernels import verify as verify_module
    from dllm.kernels import verify_triton

    def lenient(draft_tokens, draft_logits, target_logits, num_drafts=None, *, temperature, generator=None,
                seed=None, **rest):
        # a draft accepted with probability min(1, 1.5 target/draft): the classic off-by-a-factor bug
        boosted = target_logits.clone()
        index = draft_tokens.clamp(min=0)[..., None]
        width = draft_tokens.shape[1]
        boosted[:, :width].scatter_add_(-1, index, torch.full(index.shape, 0.405, dtype=boosted.dtype))
        return verify_module.verify_logits_reference(draft_tokens, draft_logits, boosted, num_drafts,
                                                     temperature=temperature, seed=draw_seed(generator), **rest)

    monkeypatch.setattr(verify_triton, "verify_logits_triton", lenient)
    answers = draw(oracle, "fef", 12000, seed=21, window=3, order="confidence")
    expected = sequential_distribution(oracle, PROMPT, GEN, order="confidence")
    assert chi_square_pvalue(answers, expected) < 1e-6


@pytest.mark.skipif(not KERNELS_RUN, reason=SKIP_REASON)
@pytest.mark.skipif(CUDA, reason="interpreter replay; on CUDA the kernel tests run at full size")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("sampler,options", [
    ("fef", {"window": 2, "order": "confidence"}),
    ("fef", {"window": 3, "draft": "stale"}),
    ("ar_spec", {"num_draft_tokens": 2}),
    ("llada", {"steps": 2}),
    ("eb", {}),
])
def test_interpreted_kernels_replay_the_contract(oracle, monkeypatch, sampler, options):
    from dllm.kernels import sampling_triton, verify_triton

    if type(verify_triton._emit_kernel).__name__ != "InterpretedFunction":
        pytest.skip("kernels were defined before TRITON_INTERPRET=1 was set")
    model = oracle.as_causal() if sampler == "ar_spec" else oracle
    if sampler == "ar_spec":
        options = {**options, "drafter": oracle.perturbed(0.5).as_causal()}
    launches = []
    for module, name in ((verify_triton, "verify_logits_triton"), (sampling_triton, "sample_confidence_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _kernel=kernel, **k: launches.append(1) or _kernel(*a, **k))
    with use_kernels("triton"):
        real = draw(model, sampler, 3, seed=5, **options)
        assert launches, "the real kernels did not run"
        monkeypatch.setattr(verify_triton, "verify_logits_triton", contract_verify_logits)
        monkeypatch.setattr(sampling_triton, "sample_confidence_triton", contract_sample_confidence)
        replay = draw(model, sampler, 3, seed=5, **options)
    assert torch.equal(real, replay)


def test_modes_and_errors(monkeypatch):
    monkeypatch.delenv("DLLM_KERNELS", raising=False)
    cpu = torch.zeros(1)
    assert kernel_mode() == "auto" and use_triton(cpu) is False
    with use_kernels("reference"):
        assert kernel_mode() == "reference" and use_triton(cpu) is False
        with use_kernels("auto"):
            assert kernel_mode() == "auto"
        assert kernel_mode() == "reference"
    assert kernel_mode() == "auto"
    monkeypatch.setenv("DLLM_KERNELS", "Reference")
    assert kernel_mode() == "reference"
    monkeypatch.setenv("DLLM_KERNELS", "fast")
    with pytest.raises(ValueError, match="DLLM_KERNELS must be one of auto, reference, triton; got 'fast'"):
        kernel_mode()
    with pytest.raises(ValueError, match="use_kernels: mode must be one of"):
        with use_kernels("cuda"):
            pass
    monkeypatch.delenv("DLLM_KERNELS")
    if HAVE_TRITON:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with use_kernels("triton"), pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
            use_triton(cpu)
    assert os.environ.get("DLLM_KERNELS") is None


def test_mode_is_per_thread_and_row_generators_take_the_reference(monkeypatch):
    import threading

    seen = []
    with use_kernels("reference"):
        worker = threading.Thread(target=lambda: seen.append(kernel_mode()))
        worker.start()
        worker.join()
    assert seen == ["auto"]
    # per-row generators never reach a kernel, so even a mode that cannot run here does not matter
    from dllm.kernels import verify_logits
    from dllm.numerics import RowGenerators

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    drafts, logits = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 2, 3)
    generators = RowGenerators([torch.Generator().manual_seed(i) for i in range(2)])
    with use_kernels("triton"):
        out = verify_logits(drafts, logits[:, :1], logits, temperature=1.0, generator=generators)
    assert out.num_emitted.tolist() == [2, 2]  # equal draft and target: accepted, plus the bonus
