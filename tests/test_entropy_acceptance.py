"""Acceptance against the target's entropy: the per-draft record (fef, ar_spec), its fit, and dllm bench's output."""

import json

import pytest
import torch
from test_bench import model_flags, save_tiny_models

import dllm
from dllm.eval.study import bench
from dllm.models.oracle import HMMOracle
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers.sessions import choose_session
from dllm.stats import EntropyAcceptance, draft_outcomes, linear_fit, target_entropy


def independent_entropy(logits: torch.Tensor, forbid: int | None = None) -> float:
    """Entropy (nats) of softmax(logits) at temperature 1 by torch.distributions, in float64."""
    logits = logits.double().clone()
    if forbid is not None:
        logits[forbid] = -torch.inf
    return float(torch.distributions.Categorical(logits=logits).entropy())


class Recorder:
    """A callback keeping every event (detached) and feeding an EntropyAcceptance."""

    def __init__(self):
        self.events, self.record = [], EntropyAcceptance()

    def __call__(self, event):
        self.record(event)
        self.events.append(event.detached(logits=True))


# --------------------------------------------------------------------------------------------------------
# The record's pieces
# --------------------------------------------------------------------------------------------------------


def test_target_entropy_matches_categorical_with_forbidden_tokens_and_bf16():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :, 4] = -torch.inf  # a forbidden token contributes 0, not nan
    expected = torch.distributions.Categorical(logits=logits.double()).entropy()
    assert torch.allclose(target_entropy(logits).double(), expected, atol=1e-5)
    assert torch.allclose(target_entropy(logits.bfloat16()).double(),
                          torch.distributions.Categorical(logits=logits.bfloat16().double()).entropy(), atol=1e-4)
    point = torch.full((1, 6), -torch.inf)
    point[0, 2] = 0.0
    assert target_entropy(point).item() == 0.0


def test_draft_outcomes_stop_after_the_first_rejection():
    target = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(1))  # [R, K + 1, V]
    num_drafts, num_accepted = torch.tensor([3, 2, 0]), torch.tensor([1, 2, 0])
    entropy, accepted = draft_outcomes(target, num_drafts, num_accepted)
    # row 0: drafts 0 (accepted) and 1 (rejected; 2 never met the target); row 1: both accepted; row 2: none
    assert accepted.tolist() == [True, False, True, True]
    expected = [independent_entropy(target[r, j]) for r, j in ((0, 0), (0, 1), (1, 0), (1, 1))]
    assert torch.allclose(entropy.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    empty = draft_outcomes(target, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert empty[0].numel() == empty[1].numel() == 0


def test_fit_and_bins_on_a_synthetic_table():
    # by hand: mean x 1, mean y 0.5, sum (x - 1)(y - 0.5) = -2, sum (x - 1)^2 = 4 -> slope -0.5, intercept 1
    assert linear_fit(torch.tensor([0.0, 0, 1, 1, 2, 2]), torch.tensor([1.0, 1, 1, 0, 0, 0])) == (-0.5, 1.0)
    assert linear_fit(torch.tensor([0.7, 0.7]), torch.tensor([1.0, 0.0])) == (None, 0.5)  # no spread: no slope
    assert linear_fit(torch.tensor([]), torch.tensor([])) == (None, None)
    record = EntropyAcceptance([0.1, 0.2, 0.6, 0.7, 1.2], [True, True, True, False, False])
    fit = record.fit()
    slope, intercept = torch.linalg.lstsq(torch.tensor([[0.1, 1], [0.2, 1], [0.6, 1], [0.7, 1], [1.2, 1]],
                                                       dtype=torch.float64),
                                          torch.tensor([[1.0], [1], [1], [0], [0]], dtype=torch.float64)).solution
    assert fit["slope"] == pytest.approx(float(slope)) and fit["intercept"] == pytest.approx(float(intercept))
    assert (fit["num_drafts"], fit["acceptance"]) == (5, 0.6)
    assert [(b["low"], b["num_drafts"], b["acceptance"]) for b in fit["bins"]] == [(0.0, 2, 1.0), (0.5, 2, 0.5),
                                                                                    (1.0, 1, 0.0)]
    assert fit["bins"][1]["mean_entropy"] == pytest.approx(0.65)
    assert EntropyAcceptance().fit()["slope"] is None


# --------------------------------------------------------------------------------------------------------
# What the samplers record, against the target recomputed from scratch
# --------------------------------------------------------------------------------------------------------


def check_fef_events(model, events, prompt_len: int, forbid: int, **call):
    """Recompute each tested draft's target by one plain model call (keywords ``call``) on the state before the
    round with the earlier drafts revealed, at the draft's position; the recorded entropy must be its entropy."""
    state = events[0].x.clone()
    state[:, prompt_len:] = forbid  # the canvas before the first round: prompt, then masks
    checked = 0
    for event in events:
        entropy, accepted = event.draft_outcomes()
        k = 0
        for i, row in enumerate(event.rows.tolist()):
            n_acc, n_drafts = int(event.num_accepted[i]), int(event.num_drafts[i])
            assert int(accepted[k : k + min(n_acc + 1, n_drafts)].sum()) == n_acc
            for j in range(min(n_acc + 1, n_drafts)):
                x = state[row].clone()
                x[event.window[i, :j]] = event.drafts[i, :j]
                logits = model(x[None], **call)[0, int(event.window[i, j])]
                assert float(entropy[k]) == pytest.approx(independent_entropy(logits, forbid), abs=1e-5)
                assert bool(accepted[k]) == (j < n_acc)
                k += 1
                checked += 1
            state[row] = event.x[i]
        assert k == entropy.numel()
    return checked


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])  # the entropy is at temperature 1 whatever the run's
@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
def test_fef_records_the_entropy_of_each_tested_draft_oracle(temperature, order):
    oracle = HMMOracle.random(num_states=3, num_tokens=6, seed=3)
    prompt = torch.tensor([[0, 1, 2], [3, 3, 4]])
    seen = Recorder()
    out = dllm.generate(oracle, prompt, sampler="fef", max_new_tokens=10, temperature=temperature, window=4,
                        order=order, generator=torch.Generator().manual_seed(0), callback=seen, eos_token_id=None)
    assert check_fef_events(oracle, seen.events, prompt.shape[1], oracle.mask_token_id) == len(seen.record.entropy)
    assert sum(seen.record.accepted) == out.stats.accepted  # acceptance recorded matches num_accepted
    assert len(seen.record.entropy) > out.stats.rounds  # more than the always-accepted first draft of each round


@pytest.mark.parametrize("draft,verifier,layers", [("marginal", "copies", 2), ("stale", "copies", 2),
                                                   ("stale", "structured", 1)])  # one layer: structured is exact
def test_fef_records_through_the_block_cache_of_a_transformer(draft, verifier, layers):
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=24, dim=32, n_layers=layers, n_heads=2, max_seq_len=64,
                                            layout="block_causal", block_size=4, mask_token_id=23,
                                            tie_embeddings=False)).eval()
    with torch.no_grad():
        model.output.weight.mul_(100.0)  # sharp, varied distributions (random init is near uniform): entropies differ
    assert choose_session("auto", model, 4) == "block"  # the calls go through the exact block cache
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    seen = Recorder()
    with torch.inference_mode():
        out = dllm.generate(model, prompt, sampler="fef", max_new_tokens=12, temperature=1.0, window=4, draft=draft,
                            verifier=verifier, block_length=4, generator=torch.Generator().manual_seed(1),
                            callback=seen, eos_token_id=None)
        # blocks start at the answer, as the sampler's calls have them
        checked = check_fef_events(model, seen.events, prompt.shape[1], 23, block_offset=prompt.shape[1])
    assert checked == len(seen.record.entropy) > 0 and len(set(seen.record.accepted)) == 2
    assert sum(seen.record.accepted) == out.stats.accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_ar_spec_records_the_entropy_of_each_tested_draft(temperature, drafter):
    oracle = HMMOracle.random(num_states=3, num_tokens=6, seed=5, stickiness=2.0)
    target = oracle.as_causal()
    prompt = torch.tensor([[0, 1, 0, 1, 0, 1], [2, 2, 3, 2, 2, 3]])
    seen = Recorder()
    out = dllm.generate(target, prompt, sampler="ar_spec", max_new_tokens=12, temperature=temperature,
                        drafter=oracle.perturbed().as_causal() if drafter == "model" else "ngram",
                        num_draft_tokens=4, generator=torch.Generator().manual_seed(2), callback=seen,
                        eos_token_id=None)
    lengths = {row: prompt.shape[1] for row in range(prompt.shape[0])}
    state = {row: prompt[row] for row in lengths}
    for event in seen.events:
        entropy, accepted = event.draft_outcomes()
        k = 0
        for i, row in enumerate(event.rows.tolist()):
            n_acc, n_drafts = int(event.num_accepted[i]), int(event.num_drafts[i])
            for j in range(min(n_acc + 1, n_drafts)):
                seq = torch.cat([state[row][: lengths[row]], event.drafts[i, :j]])
                logits = target(seq[None])[0, -1]  # the next-token distribution at draft j's position
                assert float(entropy[k]) == pytest.approx(independent_entropy(logits), abs=1e-5)
                assert bool(accepted[k]) == (j < n_acc)
                k += 1
            lengths[row] += n_acc + 1  # accepted drafts plus the correction or bonus
            state[row] = event.x[i]
        assert k == entropy.numel()
    assert sum(seen.record.accepted) == out.stats.accepted
    assert len(seen.record.entropy) > 0  # (n-gram rounds without a match test nothing)


# --------------------------------------------------------------------------------------------------------
# dllm bench
# --------------------------------------------------------------------------------------------------------


def test_bench_writes_the_fit_the_table_and_the_plot(tmp_path):
    paths = save_tiny_models(tmp_path / "models")
    configs = ["name=fef w4;model=diffusion;sampler=fef;window=4;temperature=0",
               "name=fef w4 T1;model=diffusion;sampler=fef;window=4;temperature=1",
               "name=ar_spec k4 T1;model=ar;sampler=ar_spec;drafter=diffusion;num_draft_tokens=4;temperature=1",
               "name=ar greedy;model=ar;sampler=ar"]
    out = tmp_path / "study"
    argv = model_flags(paths) + [flag for c in configs for flag in ("--config", c)] + [
        "--num-prompts", "2", "--max-new-tokens", "8", "--batch-size", "1", "--repeats", "1", "--threads", "1",
        "--output", str(out)]
    assert bench.main(argv) == 0
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["ar greedy"]["acceptance_vs_entropy"] is None
    for name in ("fef w4", "fef w4 T1", "ar_spec k4 T1"):
        fit = runs[name]["acceptance_vs_entropy"]
        assert fit["num_drafts"] > 0 and sum(b["num_drafts"] for b in fit["bins"]) == fit["num_drafts"]
        assert {"slope", "intercept", "acceptance", "bin_nats", "entropy"} <= set(fit)
        assert 0.0 <= fit["acceptance"] <= 1.0 and all(0 <= b["low"] <= b["mean_entropy"] < b["high"]
                                                       for b in fit["bins"])
    report = (out / "results.md").read_text()
    assert "| fef w4 T1 | 1 |" in report and "slope" in report and "intercept" in report
    pytest.importorskip("matplotlib")
    assert (out / "acceptance_entropy.png").stat().st_size > 0


def test_detached_events_drop_the_target_logits_unless_asked():
    seen = []
    dllm.generate(HMMOracle.random(seed=1), torch.tensor([[0, 1]]), sampler="fef", max_new_tokens=4, window=2,
                  generator=torch.Generator().manual_seed(0), callback=lambda e: seen.append(
                      (e.detached(), e.detached(logits=True))), eos_token_id=None)
    assert all(plain.target_logits is None and kept.target_logits is not None for plain, kept in seen)
    assert all(plain.draft_outcomes()[0].numel() == 0 for plain, _ in seen)


def test_bad_bin_width_is_refused_naming_it():
    with pytest.raises(ValueError, match="bin_nats must be a number > 0"):
        EntropyAcceptance([0.1], [True]).fit(bin_nats=0)
