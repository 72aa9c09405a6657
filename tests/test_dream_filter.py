"""The ``dream`` sampler's logit filter follows Dream's ``sample_tokens``: temperature, top_p, then top_k.

Checked against an independent implementation of Dream's rule written here on plain floats, and against
the real function in Dream's remote code (shared/remote_code, a test fixture loaded from its path).
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from dllm.samplers.baselines.steppers import _filter_logits

REPO = Path(__file__).resolve().parents[1]
# The repository sits beside shared/; a helper's worktree (wt/<name>) sits one level deeper.
REMOTE = next((base / "shared" / "remote_code" / "dream" / "generation_utils.py" for base in REPO.parents[:2]
               if (base / "shared" / "remote_code" / "dream").is_dir()), None)

SETTINGS = [(1.0, 0.6, 2), (0.7, 0.9, 3), (1.0, 0.3, 5), (1.3, 0.95, 1), (1.0, 0.8, None), (1.0, None, 3),
            (0.0, 0.7, 3)]


def dream_rule(logits: list[float], temperature: float, top_p, top_k) -> list[float]:
    """Dream's truncated distribution for one row: keep tokens, best first, until those kept hold more
    than top_p (the one that crosses is kept); of those, keep the top_k best; renormalise."""
    scaled = [x / temperature for x in logits] if temperature > 0 else list(logits)
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    ranked = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept, held = [], 0.0
    for i in ranked:
        if top_p is not None and top_p < 1 and held > top_p:
            break
        kept.append(i)
        held += probs[i]
    if top_k is not None:
        kept = kept[:top_k]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(scaled))]


def top_k_then_top_p(logits: list[float], temperature: float, top_p, top_k) -> list[float]:
    """The other order (what _filter_logits did before): top_k first, then top_p on what is left."""
    scaled = [x / temperature for x in logits] if temperature > 0 else list(logits)
    if top_k is not None:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    return dream_rule(scaled, 1.0, top_p, None)


def random_logits(rows=64, vocab=8, seed=0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_filter_matches_dreams_rule(temperature, top_p, top_k):
    logits = random_logits(seed=int(10 * (top_p or 0)))
    ours = torch.softmax(_filter_logits(logits, temperature, top_p, top_k), dim=-1)
    expected = torch.tensor([dream_rule(row, temperature, top_p, top_k) for row in logits.tolist()])
    assert torch.allclose(ours, expected, atol=1e-6)


def test_the_order_matters_on_these_rows():
    """Power: with both filters set, the two orders keep different tokens on some of the test rows."""
    logits = random_logits(seed=6).tolist()
    differ = sum((torch.tensor(dream_rule(row, 1.0, 0.6, 2)) > 0).tolist()
                 != (torch.tensor(top_k_then_top_p(row, 1.0, 0.6, 2)) > 0).tolist() for row in logits)
    assert differ >= 5


def test_hand_built_row():
    """probs (0.5, 0.3, 0.2), top_p 0.6, top_k 2: Dream keeps the first two (0.5 does not exceed 0.6);
    top_k first would renormalise to (0.625, 0.375) and top_p would then keep only the first."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = torch.isfinite(_filter_logits(logits, 1.0, 0.6, 2))
    assert kept.tolist() == [[True, True, False]]


@pytest.fixture(scope="module")
def dream_code():
    if REMOTE is None:
        pytest.skip("shared/remote_code/dream is absent")
    spec = importlib.util.spec_from_file_location("dream_generation_utils_fixture", REMOTE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_filter_matches_dreams_sample_tokens(dream_code, temperature, top_p, top_k):
    """Dream's own sample_tokens: its confidences (top-1 minus top-2, negative entropy) are functions of the
    filtered distribution, and every token it samples lies in our support."""
    logits = random_logits(rows=256, seed=3)
    ours = torch.softmax(_filter_logits(logits, temperature, top_p, top_k), dim=-1)
    margin, _ = dream_code.sample_tokens(logits, temperature, top_p, top_k, margin_confidence=True)
    top = ours.sort(dim=-1, descending=True).values
    assert torch.allclose(margin, top[:, 0] - top[:, 1], atol=1e-6)
    entropy, _ = dream_code.sample_tokens(logits, temperature, top_p, top_k, neg_entropy=True)
    assert torch.allclose(entropy, (ours * torch.log(ours + 1e-10)).sum(-1), atol=1e-5)
    torch.manual_seed(0)  # sample_tokens draws from torch's global generator
    _, tokens = dream_code.sample_tokens(logits.repeat(20, 1), temperature, top_p, top_k)
    assert bool((ours.repeat(20, 1).gather(1, tokens[:, None]) > 0).all())
