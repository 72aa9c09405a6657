"""The two-stream layout (dllm/models/two_stream.py) and its samplers (samplers/fef/two_stream.py).

The ground truth is the law enumerated from the layout's own definition (uncached calls, one per decision
state): the product of query conditionals in the order the sampler's rule reveals positions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.models.two_stream import TwoStreamLM
from dllm.numerics import forbid_token
from dllm.samplers.order import top1_probability
from dllm.training.batches import Example
from dllm.training.prefix import build_stream_batch, stream_loss

from stat_tools import ALPHA, chi_square_pvalue

VOCAB, MASK = 5, 4  # tokens 0..3, the mask token 4
PROMPT = torch.tensor([1, 3, 0])


@pytest.fixture(scope="module")
def model() -> TwoStreamLM:
    """A small random two-stream model with sharp, strongly context-dependent conditionals."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=64,
                               layout="bidirectional", mask_token_id=MASK)
    base = TransformerLM(config)
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() >= 2:
                p.mul_(12.0)
    return TwoStreamLM(base, block_size=2).eval()


def enumerated_law(model, prompt, gen_length, temperature, order, block_length):
    """{answer: probability} of the chain, by brute force over reveal sequences (uncached calls)."""
    p = prompt.numel()
    cols = torch.arange(p + gen_length)
    # A state: the canvas and the reveal order (content ids/positions in that order).
    canvas = torch.cat([prompt, torch.full((gen_length,), MASK)])[None]
    content, content_pos = prompt[None].clone(), torch.arange(p)[None]
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(gen_length):
        n = canvas.shape[0]
        query_pos = cols[p:].expand(n, -1)
        sees = torch.full_like(query_pos, content.shape[1])
        with torch.no_grad():
            logits = model.streams(content, content_pos, torch.ones_like(content, dtype=torch.bool), query_pos, sees)
        logits = forbid_token(logits, MASK)
        masked = canvas[:, p:] == MASK
        block = torch.div(cols[p:] - p, block_length, rounding_mode="floor")
        active = torch.where(masked, block, 10**6).min(dim=1).values
        candidates = masked & (block[None] == active[:, None])
        if order == "left_to_right":
            score = -cols[p:].float().expand(n, -1)
        else:
            score = top1_probability(logits)
        pick = torch.where(candidates, score, float("-inf")).argmax(dim=1)  # [n] answer offsets
        chosen = logits[torch.arange(n), pick]
        if temperature == 0:
            step = torch.zeros_like(chosen, dtype=torch.float64).scatter_(1, chosen.argmax(-1, keepdim=True), 1.0)
        else:
            step = torch.softmax(chosen.double() / temperature, dim=-1)
        parent, token = (step > 0).nonzero(as_tuple=True)
        canvas = canvas[parent].clone()
        canvas[torch.arange(parent.numel()), p + pick[parent]] = token
        content = torch.cat([content[parent], token[:, None]], dim=1)
        content_pos = torch.cat([content_pos[parent], (p + pick[parent])[:, None]], dim=1)
        probs = probs[parent] * step[parent, token]
    law: dict[tuple[int, ...], float] = {}
    for answer, prob in zip(canvas[:, p:].tolist(), probs.tolist()):
        law[tuple(answer)] = law.get(tuple(answer), 0.0) + prob
    return law


def _sample(model, sampler, n, temperature, order, block_length, seed=0, **options):
    prompt = PROMPT[None].expand(n, -1)
    if order is not None:
        options["order"] = order
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=4, temperature=temperature,
                            generator=generator, eos_token_id=None, block_length=block_length, **options)
    return out


def test_cached_logits_equal_uncached_recomputation(model):
    """Content appended one token per call (the cache) gives the logits of one uncached call."""
    ids = torch.tensor([[1, 3, 0, 2, 1, 0, 3]])
    pos = torch.tensor([[0, 1, 2, 5, 3, 6, 4]])  # reveal order differs from position order
    query = torch.tensor([[7, 8, 4]])
    ones = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        cache = model.new_cache(1)
        for i in range(ids.shape[1]):
            cached = model.streams(ids[:, i:i + 1], pos[:, i:i + 1], ones[:, :1], query, torch.ones_like(query),
                                   cache=cache, append=True)
            full = model.streams(ids[:, :i + 1], pos[:, :i + 1], ones[:, :i + 1], query,
                                 torch.full_like(query, i + 1))
            assert torch.allclose(forbid_token(cached, MASK)[..., :MASK], full[..., :MASK], atol=1e-5)


def test_rejected_content_is_forgotten(model):
    """Entries dropped by ``keep`` are attended by no one: logits as if they were never appended."""
    with torch.no_grad():
        cache = model.new_cache(1)
        ones = torch.ones(1, 3, dtype=torch.bool)
        query = torch.tensor([[6]])
        model.streams(PROMPT[None], torch.arange(3)[None], ones, query, torch.ones_like(query), cache=cache,
                      append=True)
        model.streams(torch.tensor([[2, 1]]), torch.tensor([[3, 4]]), ones[:, :2], query, torch.ones_like(query),
                      cache=cache, append=True)
        cache.keep(torch.tensor([0]), torch.tensor([[True, False]]))
        after = model.streams(torch.tensor([[0]]), torch.tensor([[5]]), ones[:, :1], query, torch.ones_like(query),
                              cache=cache)
        full = model.streams(torch.tensor([[1, 3, 0, 2, 0]]), torch.tensor([[0, 1, 2, 3, 5]]), ones.new_ones(1, 5),
                             query, torch.full_like(query, 5))
    assert torch.allclose(after[..., :MASK], full[..., :MASK], atol=1e-5)


def test_the_law_depends_on_the_reveal_order(model):
    """Confidence order's chain differs from left-to-right's: the enumeration tells them apart."""
    a = enumerated_law(model, PROMPT, 4, 1.0, "left_to_right", 2)
    b = enumerated_law(model, PROMPT, 4, 1.0, "confidence", 2)
    assert abs(sum(a.values()) - 1) < 1e-9 and abs(sum(b.values()) - 1) < 1e-9
    assert max(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)) > 0.01


@pytest.mark.parametrize("sampler,options", [("sequential", {}), ("fef", {"window": 2}), ("fef", {"window": 4})])
@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("temperature,block_length", [(1.0, 2), (0.7, 4), (1.0, 4)])
def test_samplers_are_exact(model, sampler, options, order, temperature, block_length):
    law = enumerated_law(model, PROMPT, 4, temperature, order, block_length)
    out = _sample(model, sampler, 3000, temperature, order, block_length, **options)
    assert out.exact
    assert chi_square_pvalue(out.sequences[:, 3:], law) > ALPHA


@pytest.mark.parametrize("sampler,options", [("sequential", {}), ("fef", {"window": 2}), ("fef", {"window": 4})])
def test_an_empty_prompt_decodes_exactly(model, sampler, options):
    """No prompt: the first round's pending content is empty (it crashed before) and the law is still the chain's."""
    empty = PROMPT[:0]
    law = enumerated_law(model, empty, 4, 1.0, "left_to_right", 2)
    with torch.no_grad():
        out = dllm.generate(model, empty[None].expand(3000, -1), sampler=sampler, max_new_tokens=4, temperature=1.0,
                            generator=torch.Generator().manual_seed(0), eos_token_id=None, block_length=2, **options)
    assert chi_square_pvalue(out.sequences, law) > ALPHA


def test_factorized_parallel_unmasking_fails(model):
    """The test has power: llada revealing a whole block from its marginals is not the chain."""
    law = enumerated_law(model, PROMPT, 4, 1.0, "left_to_right", 4)
    out = _sample(model, "llada", 3000, 1.0, None, 4, steps=1)
    assert chi_square_pvalue(out.sequences[:, 3:], law) < ALPHA


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("window,block_length", [(1, 2), (3, 4), (4, 2)])
def test_greedy_fef_equals_greedy_sequential(model, order, window, block_length):
    prompts = torch.tensor([[1, 3, 0], [2, 2, 1], [0, 1, 3], [3, 3, 3]])
    runs = []
    for sampler, options in (("sequential", {}), ("fef", {"window": window})):
        with torch.no_grad():
            runs.append(dllm.generate(model, prompts, sampler=sampler, max_new_tokens=8, temperature=0,
                                      eos_token_id=None, order=order, block_length=block_length, **options))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    law = enumerated_law(model, prompts[0], 8, 0, order, block_length)
    assert law == {tuple(runs[0].sequences[0, 3:].tolist()): 1.0}


def test_sequential_costs_two_tokens_per_step(model):
    """left_to_right sequential: one call per token, one content token and one query each (the prompt
    rides along the first call)."""
    out = _sample(model, "sequential", 1, 1.0, "left_to_right", 4)
    assert out.stats.nfe == 4 and out.stats.forward_tokens == (3 + 1) + 3 * 2


def test_training_loss_is_the_chain_log_likelihood(model):
    """One training pass scores every region token exactly as the cached chain does in that order."""
    example = Example(prompt=(1, 3, 0), region=(2, 0, 1, 3), answer_tokens=4)
    generator = torch.Generator().manual_seed(3)
    batch = build_stream_batch([example], pad_id=0, block_size=2, generator=generator, in_order_prob=0.0)
    with torch.no_grad():
        loss = float(stream_loss(model, batch, "fp32", torch.device("cpu")))
    order = (batch.query_pos[0] - 3).tolist()
    assert sorted(order[:2]) == [0, 1] and sorted(order[2:]) == [2, 3]  # blocks left to right
    total = 0.0
    with torch.no_grad():
        cache = model.new_cache(1)
        pending, pending_pos = torch.tensor([[1, 3, 0]]), torch.arange(3)[None]
        for offset in order:
            query = torch.tensor([[3 + offset]])
            logits = model.streams(pending, pending_pos, torch.ones_like(pending, dtype=torch.bool), query,
                                   torch.full_like(query, pending.shape[1]), cache=cache, append=True)
            token = example.region[offset]
            total -= float(torch.log_softmax(logits[0, 0], dim=-1)[token])
            pending, pending_pos = torch.tensor([[token]]), query
    assert abs(loss - total) < 1e-4


def test_prefix_conditioned_recipe_trains_and_ships_a_two_stream_folder(tmp_path):
    """``dllm train --recipe prefix-conditioned`` runs end to end and saves a folder dllm.load reads."""
    from dllm.train import main
    from dllm.training.recipes import RECIPES

    assert RECIPES["prefix-conditioned"] == "dllm.training.prefix"
    shipped = Path(__file__).resolve().parents[1] / "dllm" / "weights" / "diffusion"
    init = tmp_path / "init"
    torch.manual_seed(0)
    tiny = TransformerLM(TransformerConfig(vocab_size=495, dim=32, n_layers=1, n_heads=2, max_seq_len=256,
                                           layout="block_causal", block_size=8, mask_token_id=2, eos_token_id=1,
                                           pad_token_id=0))
    tiny.save_pretrained(init)
    (init / "tokenizer.json").write_bytes((shipped / "tokenizer.json").read_bytes())
    out = tmp_path / "run"
    settings = ["train.steps=2", "train.batch_size=4", "train.micro_batch_size=2", "train.log_every=1",
                "train.eval_every=2", "train.eval_problems=2", "train.warmup_steps=1"]
    config = Path(__file__).resolve().parents[1] / "configs" / "prefix_conditioned.toml"
    args = ["--recipe", "prefix-conditioned", "--config", str(config), "--init", str(init), "--output", str(out)]
    assert main(args + [a for s in settings for a in ("--set", s)]) == 0
    loaded = dllm.load(out / "model")
    assert isinstance(loaded, TwoStreamLM) and loaded.capabilities.one_pass_exact and loaded.block_size == 8
    assert not torch.equal(loaded.base.layers[0].attn.wqkv.weight, tiny.layers[0].attn.wqkv.weight)


def test_recipe_settings_are_checked_by_name(tmp_path):
    from dllm.training.prefix import PrefixConfig, read_config

    with pytest.raises(ValueError, match="prefix.left_to_right_prob"):
        PrefixConfig(left_to_right_prob=2)
    bad = tmp_path / "bad.toml"
    bad.write_text("[prefix]\nblok_size = 8\n")
    with pytest.raises(ValueError, match="unknown \\[prefix\\] keys \\['blok_size'\\]"):
        read_config(str(bad), [])


def test_block_cache_option_is_refused_by_name(model):
    with pytest.raises(ValueError, match="cache='block'"):
        _sample(model, "fef", 1, 1.0, "left_to_right", 2, window=2, cache="block")


@pytest.mark.parametrize("sampler,options", [("sequential", {}), ("fef", {"window": 3})])
def test_ragged_batch_equals_rows_alone(model, sampler, options):
    """Left padding, EOS stops and rows finishing at different rounds change no row's greedy answer."""
    prompts = [[1, 3, 0], [2, 1], [0, 1, 3, 3], [3]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    common = dict(sampler=sampler, max_new_tokens=8, temperature=0, eos_token_id=0, order="confidence",
                  block_length=4, **options)
    with torch.no_grad():
        batch = dllm.generate(model, ids, attention_mask=mask, **common).sequences[:, width:]
        for row, prompt in enumerate(prompts):
            alone = dllm.generate(model, torch.tensor([prompt]), **common).sequences[0, len(prompt):]
            assert torch.equal(batch[row], alone)


def test_position_order_enumeration_refuses_a_reveal_order_chain(model):
    from dllm.samplers import sequential_distribution

    # Left to right, position order is the reveal order: the same law, up to float32 logits.
    assert sequential_distribution(model, PROMPT, 3, order="left_to_right", block_length=3) == pytest.approx(
        enumerated_law(model, PROMPT, 3, 1.0, "left_to_right", 3), abs=1e-6)
    with pytest.raises(ValueError, match="reveal order"):
        sequential_distribution(model, PROMPT, 3, order="confidence")


SHIPPED = Path(dllm.__file__).parent / "weights" / "two_stream"


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").exists(), reason="shipped weights not present")
def test_shipped_two_stream_model_greedy_fef_is_sequential():
    from dllm.data.synthetic import format_example, heldout_set

    shipped = dllm.load(SHIPPED)
    assert isinstance(shipped, TwoStreamLM) and shipped.capabilities.one_pass_exact
    tokenizer = shipped.tokenizer
    for problem in heldout_set()[:3]:
        prompt = torch.tensor([tokenizer(format_example(problem["question"]), add_special_tokens=False)["input_ids"]])
        runs = [dllm.generate(shipped, prompt, sampler=s, max_new_tokens=32, temperature=0, **o)
                for s, o in (("sequential", {}), ("fef", {"window": 4}), ("fef", {"window": 4, "block_length": 32}),
                             ("fef", {"window": 8, "draft": "head", "draft_candidates": 2, "candidates_below": 0.9}))]
        assert runs[1].exact and all(torch.equal(runs[0].sequences, r.sequences) for r in runs[1:])


# ---- fef's draft="head" on this layout (samplers/fef/two_stream.py, dllm/training/two_stream_head.py) ----


def _random_head(model, seed=0, scale=3.0):
    """A condition_first head with a large random correction: its drafts are far from the marginals."""
    from dllm.models.draft_head import DraftHead, DraftHeadConfig

    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig(vocab_size=VOCAB, backbone_dim=model.config.dim, dim=16, n_heads=2,
                                     mask_token_id=MASK, condition_first=True))
    with torch.no_grad():
        torch.nn.init.normal_(head.out.weight, std=scale)
    return head.eval()


@pytest.mark.parametrize("window", [2, 4])
@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
@pytest.mark.parametrize("temperature,block_length", [(1.0, 2), (0.7, 4)])
def test_fef_with_a_random_head_is_exact(model, window, order, temperature, block_length):
    law = enumerated_law(model, PROMPT, 4, temperature, order, block_length)
    out = _sample(model, "fef", 3000, temperature, order, block_length, window=window, draft="head",
                  draft_head=_random_head(model))
    assert out.exact
    assert out.stats.drafted > 0 and out.stats.accepted < out.stats.drafted  # the head's drafts were tested
    assert chi_square_pvalue(out.sequences[:, 3:], law) > ALPHA


def test_head_drafts_reported_as_the_marginals_fail(model, monkeypatch):
    """The test has power: sampling from the head but handing the verifier the stored marginals is not exact."""
    import dllm.samplers.fef.two_stream as two_stream

    real = two_stream.head_drafts

    def lying(head, features, base, *args, **kwargs):
        tokens, _ = real(head, features, base, *args, **kwargs)
        return tokens, forbid_token(base, MASK)

    monkeypatch.setattr(two_stream, "head_drafts", lying)
    law = enumerated_law(model, PROMPT, 4, 1.0, "left_to_right", 4)
    out = _sample(model, "fef", 3000, 1.0, "left_to_right", 4, window=4, draft="head",
                  draft_head=_random_head(model))
    assert chi_square_pvalue(out.sequences[:, 3:], law) < ALPHA


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
def test_greedy_fef_with_a_head_equals_greedy_sequential(model, order):
    prompts = torch.tensor([[1, 3, 0], [2, 2, 1], [0, 1, 3], [3, 3, 3]])
    with torch.no_grad():
        runs = [dllm.generate(model, prompts, sampler=s, max_new_tokens=8, temperature=0, eos_token_id=None,
                              order=order, block_length=4, **o)
                for s, o in (("sequential", {}), ("fef", {"window": 3, "draft": "head",
                                                          "draft_head": _random_head(model)}))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)


def test_an_untrained_head_drafts_the_marginals(model):
    """Zero correction at init, step 0 included (condition_first): the logits drafts are drawn from are the
    stored query logits, so an untrained head is fef's plain two-stream drafting."""
    from dllm.models.draft_head import DraftHead
    from dllm.samplers.fef.sources import head_drafts

    head = DraftHead(_random_head(model).config).eval()
    torch.manual_seed(1)
    features, base = torch.randn(3, 4, model.config.dim), torch.randn(3, 4, VOCAB)
    offsets = torch.ones(3, 4, dtype=torch.long)
    tokens, logits = head_drafts(head, features, base, torch.tensor([0, 1, 2]), offsets, 1.0,
                                 torch.Generator().manual_seed(0), MASK)
    assert torch.equal(logits, forbid_token(base, MASK)) and bool((tokens != MASK).all())
    moved = head_drafts(_random_head(model), features, base, torch.tensor([0, 1, 2]), offsets, 1.0,
                        torch.Generator().manual_seed(0), MASK)[1]
    assert not torch.allclose(moved[:, 0], logits[:, 0])  # a trained-like head corrects step 0 too


def test_recorded_rounds_carry_the_chain_conditionals(model):
    """collect(): the first drafting round's slot-0 target is the query at s_0 given the prompt and the
    token revealed before it (an uncached call), and that token is the head's slot-0 input."""
    from dllm.training.two_stream_head import collect

    prompt = [1, 3, 0]
    win = collect(model, [prompt], _random_head(model), window=3, temperature=0.0,
                  generator=torch.Generator().manual_seed(0), batch_size=1, max_new_tokens=8, dtype=torch.float32)
    assert len(win) > 1 and bool((win.count <= 3).all()) and bool(win.trained()[:, 0].all())
    with torch.no_grad():
        y = dllm.generate(model, torch.tensor([prompt]), sampler="sequential", max_new_tokens=8, temperature=0,
                          eos_token_id=None, block_length=8).sequences[0]
        # Round 1 reveals column 3 alone; round 2 drafts columns 4, 5, 6 after it.
        expected = model.streams(y[None, :4], torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool),
                                 torch.tensor([[4]]), torch.tensor([[4]]))[0, 0]
    assert int(win.previous[0, 0]) == int(y[3]) and int(win.offsets[0, 0]) == 1
    assert torch.allclose(win.targets[0, 0, :MASK], expected[:MASK], atol=1e-4)


def test_two_stream_head_recipe_trains_a_loadable_head(tmp_path):
    from dllm.models.draft_head import DraftHead
    from dllm.training.recipes import run_recipe

    if not (SHIPPED / "model.safetensors").exists():
        pytest.skip("shipped weights not present")
    assert run_recipe("two-stream-head", ["--prompts", "8", "--steps", "3", "--heldout", "2", "--orders",
                                          "left_to_right,confidence", "--output", str(tmp_path / "h")]) == 0
    head = DraftHead.from_pretrained(tmp_path / "h")
    assert head.config.condition_first
    report = (tmp_path / "h" / "train.json").read_text()
    assert '"heldout"' in report and '"train_windows"' in report
    assert run_recipe("two-stream-head", ["--steps", "0", "--output", str(tmp_path / "x")]) == 2
    assert run_recipe("two-stream-head", ["--prompts", "1", "--output", str(tmp_path / "x")]) == 2
    assert run_recipe("two-stream-head", ["--orders", "sideways", "--output", str(tmp_path / "x")]) == 2
    assert '"confidence T1"' in report  # both orders rolled and held out
    # --init continues a head (here at a negligible lr: the weights stay the init's, not a fresh head's)
    assert run_recipe("two-stream-head", ["--init", str(tmp_path / "h"), "--seed", "1", "--prompts", "4", "--steps",
                                          "1", "--lr", "1e-12", "--heldout", "1", "--output", str(tmp_path / "c")]) == 0
    continued = DraftHead.from_pretrained(tmp_path / "c")
    assert continued.config == head.config
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(continued.parameters(), head.parameters()))
    assert '"init"' in (tmp_path / "c" / "train.json").read_text()
    shipped_fef_head = SHIPPED.parent / "fef_head"  # a block-diffusion head: refused, naming --init
    assert run_recipe("two-stream-head", ["--init", str(shipped_fef_head), "--output", str(tmp_path / "x")]) == 2


def test_a_head_for_another_vocabulary_is_refused_by_name(model):
    from dllm.models.draft_head import DraftHead, DraftHeadConfig

    other = DraftHead(DraftHeadConfig(vocab_size=VOCAB + 3, backbone_dim=model.config.dim, dim=16, n_heads=2))
    with pytest.raises(ValueError, match="draft_head"):
        _sample(model, "fef", 2, 1.0, "left_to_right", 4, window=2, draft="head", draft_head=other)


def _pairs_file(tmp_path, records):
    import json

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pairs_are_laid_out_as_answer_regions_and_ordered_by_seed_and_step(tmp_path):
    from dllm.data.tokenizer import load_tokenizer
    from dllm.training.pairs import load_pairs

    tokenizer = load_tokenizer(Path(dllm.__file__).parent / "weights" / "diffusion" / "tokenizer.json")
    records = [{"prompt": f"Question: what is {i} + 1?\nAnswer:", "response": f"{i} + 1 = {i + 1}. #### {i + 1}"}
               for i in range(10)] + [{"prompt": "long " * 300, "response": "x"}]
    data = load_pairs(str(_pairs_file(tmp_path, records)), tokenizer, block_size=8, max_tokens=256)
    assert len(data.examples) == 10 and data.dropped == 1
    eos = tokenizer.eos_token_id
    for example in data.examples:
        assert len(example.region) % 8 == 0 and example.region[example.answer_tokens - 1:] == (eos,) * (
            len(example.region) - example.answer_tokens + 1)
        assert len(example.region) - example.answer_tokens >= 8  # one all-EOS block after the end
    # Pure function of (seed, step); shards of two processes make up the one-process batch; every
    # pair once per epoch.
    assert data.step_examples(0, 3, 4) == data.step_examples(0, 3, 4)
    assert data.step_examples(0, 3, 4) != data.step_examples(1, 3, 4)
    merged = data.step_examples(0, 3, 4, 0, 2) + data.step_examples(0, 3, 4, 1, 2)
    assert sorted(map(id, merged)) == sorted(map(id, data.step_examples(0, 3, 4)))
    epoch = [e for step in range(5) for e in data.step_examples(7, step, 2)]
    assert sorted(map(id, epoch)) == sorted(map(id, data.examples))


def test_pairs_are_checked_by_name(tmp_path):
    from dllm.data.tokenizer import load_tokenizer
    from dllm.training.pairs import load_pairs
    from dllm.training.prefix import PrefixConfig

    tokenizer = load_tokenizer(Path(dllm.__file__).parent / "weights" / "diffusion" / "tokenizer.json")
    with pytest.raises(ValueError, match="'question' and 'answer'"):
        load_pairs(str(_pairs_file(tmp_path, [{"prompt": "a", "response": "b"}])), tokenizer, block_size=8,
                   max_tokens=64, prompt_field="question", response_field="answer")
    with pytest.raises(ValueError, match="no such file"):
        load_pairs(str(tmp_path / "missing.jsonl"), tokenizer, block_size=8, max_tokens=64)
    with pytest.raises(ValueError, match="prefix.max_tokens"):
        PrefixConfig(max_tokens=1)
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}]
    with pytest.raises(ValueError, match="assistant"):
        load_pairs(str(_pairs_file(tmp_path, chat)), tokenizer, block_size=8, max_tokens=64)


def test_prefix_conditioned_recipe_trains_on_pairs(tmp_path):
    """``--set prefix.pairs=FILE``: the recipe trains on the pairs (and says how many and how many epochs)."""
    from dllm.train import main

    shipped = Path(__file__).resolve().parents[1] / "dllm" / "weights" / "diffusion"
    init = tmp_path / "init"
    torch.manual_seed(0)
    TransformerLM(TransformerConfig(vocab_size=495, dim=32, n_layers=1, n_heads=2, max_seq_len=256,
                                    layout="block_causal", block_size=8, mask_token_id=2, eos_token_id=1,
                                    pad_token_id=0)).save_pretrained(init)
    (init / "tokenizer.json").write_bytes((shipped / "tokenizer.json").read_bytes())
    pairs = _pairs_file(tmp_path, [{"prompt": f"Question: {i} + 2?\nAnswer:", "response": f"#### {i + 2}"}
                                   for i in range(6)])
    settings = ["train.steps=3", "train.batch_size=4", "train.micro_batch_size=2", "train.log_every=1",
                "train.eval_every=3", "train.eval_problems=2", "train.warmup_steps=1", f'prefix.pairs="{pairs}"']
    config = Path(__file__).resolve().parents[1] / "configs" / "prefix_conditioned.toml"
    args = ["--recipe", "prefix-conditioned", "--config", str(config), "--init", str(init), "--output",
            str(tmp_path / "run")]
    assert main(args + [a for s in settings for a in ("--set", s)]) == 0
    assert isinstance(dllm.load(tmp_path / "run" / "model"), TwoStreamLM)


def test_a_model_declares_the_settings_measured_fastest_on_it(tmp_path, model):
    """Capabilities.sampler_defaults (two_stream.json): used where the caller passes none, never over the
    caller's own; saved and loaded with the folder; a malformed table is refused naming it."""
    declared = TwoStreamLM(model.base, 2, {"fef": {"window": 3}})
    declared.save_pretrained(tmp_path / "m")
    loaded = TwoStreamLM.from_pretrained(tmp_path / "m")
    assert loaded.capabilities.sampler_defaults == (("fef", "window", 3, ()),)
    x = PROMPT[None]
    with torch.no_grad():
        assert dllm.generate(loaded, x, sampler="fef", max_new_tokens=4, block_length=4).options["window"] == 3
        out = dllm.generate(loaded, x, sampler="fef", max_new_tokens=4, block_length=4, window=2)
        assert out.options["window"] == 2
        assert "window" not in dllm.generate(loaded, x, sampler="sequential", max_new_tokens=4, block_length=4).options
    (tmp_path / "m" / "two_stream.json").write_text('{"layout": "two_stream", "sampler_defaults": {"fef": 3}}')
    with pytest.raises(ValueError, match="sampler_defaults"):
        TwoStreamLM.from_pretrained(tmp_path / "m")


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").exists(), reason="shipped weights not present")
def test_the_shipped_two_stream_model_drafts_with_its_head_by_default():
    shipped = dllm.load(SHIPPED)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert dllm.generate(shipped, x, sampler="fef", max_new_tokens=8).options["draft"] == "head"
        out = dllm.generate(shipped, x, sampler="fef", max_new_tokens=8, draft="marginal")
        assert out.options["draft"] == "marginal"
        diffusion = dllm.load(SHIPPED.parent / "diffusion")
        assert dllm.generate(diffusion, x, sampler="fef", max_new_tokens=8).options["draft"] == "marginal"
        # Only left to right: by confidence the head's steps cost more than they carry (README).
        assert dllm.generate(shipped, x, sampler="fef", max_new_tokens=8,
                             order="confidence").options["draft"] == "marginal"


def test_declared_defaults_yield_to_the_callers_choice_and_are_checked(tmp_path, model):
    head = _random_head(model)
    head.save_pretrained(tmp_path / "head")
    declared = TwoStreamLM(model.base, 2, {"fef": {"draft": "head", "draft_head": str(tmp_path / "head")}})
    x = PROMPT[None]
    with torch.no_grad():
        out = dllm.generate(declared, x, sampler="fef", max_new_tokens=4, block_length=4)
        assert out.options["draft"] == "head" and out.options["draft_head"] == str(tmp_path / "head")
        # The caller's draft drops the declared head with it (no "draft_head is used only with ..." error).
        assert dllm.generate(declared, x, sampler="fef", max_new_tokens=4, block_length=4,
                             draft="marginal").options["draft_head"] is None
    conditional = TwoStreamLM(model.base, 2, {"fef": {"window": 3, "when": {"order": "confidence"}}})
    with torch.no_grad():
        assert dllm.generate(conditional, x, sampler="fef", max_new_tokens=4, block_length=4).options["window"] == 8
        assert dllm.generate(conditional, x, sampler="fef", max_new_tokens=4, block_length=4,
                             order="confidence").options["window"] == 3
    with pytest.raises(ValueError, match="sampler_defaults \\['windo'\\]"):
        dllm.generate(TwoStreamLM(model.base, 2, {"fef": {"windo": 3}}), x, sampler="fef", max_new_tokens=4)


def test_a_head_for_the_other_layout_is_refused_by_name(model):
    """A block-diffusion head's step 0 is the state's own marginal; a two-stream model needs condition_first."""
    from dllm.models.draft_head import DraftHead, DraftHeadConfig

    plain = DraftHead(DraftHeadConfig(vocab_size=VOCAB, backbone_dim=model.config.dim, dim=16, n_heads=2))
    with pytest.raises(ValueError, match="draft_head=.*condition_first=True"):
        _sample(model, "fef", 2, 1.0, "left_to_right", 4, window=2, draft="head", draft_head=plain)


def test_pairs_split_holds_out_the_last_pairs(tmp_path):
    from dllm.data.tokenizer import load_tokenizer
    from dllm.training.pairs import load_pairs

    tokenizer = load_tokenizer(Path(dllm.__file__).parent / "weights" / "diffusion" / "tokenizer.json")
    records = [{"prompt": f"Question: {i}?\nAnswer:", "response": f"#### {i}"} for i in range(6)]
    data = load_pairs(str(_pairs_file(tmp_path, records)), tokenizer, block_size=8, max_tokens=256)
    train, held = data.split(2)
    assert len(train.examples) == 4 and held == data.examples[4:]
    assert not {id(e) for step in range(4) for e in train.step_examples(0, step, 2)} & {id(e) for e in held}


# ---- fef's draft trees on this layout (draft_candidates; samplers/fef/two_stream.py: _Tree) ----

def _branches(monkeypatch):
    """Spy on the verifier: how many rows accepted a sibling (a list, appended per round; its attribute
    ``continued``: how many of them accepted continuation drafts after it)."""
    import dllm.samplers.fef.two_stream as two_stream

    class Taken(list):
        pass

    taken, real = Taken(), two_stream.rejection_sample
    continued = taken.continued = []

    def spy(*args, **kwargs):
        outcome = real(*args, **kwargs)
        if outcome.branch is not None:
            taken.append(int((outcome.branch > 0).sum()))
            continued.append(int((outcome.num_accepted > outcome.branch_depth + 1)[outcome.branch > 0].sum()))
        return outcome

    monkeypatch.setattr(two_stream, "rejection_sample", spy)
    return taken


@pytest.mark.parametrize("draft,candidates,below,window,temperature", [
    ("marginal", 2, None, 4, 1.0),
    ("marginal", 3, None, 2, 0.7),
    ("marginal", 2, 0.9, 4, 1.0),
    ("head", 2, None, 4, 1.0),
    ("head", 3, None, 4, 0.7),
    ("head", 2, 0.9, 3, 0.7),
])
def test_fef_draft_trees_are_exact(model, monkeypatch, draft, candidates, below, window, temperature):
    """Siblings of each draft, verified in the same call by the recursive rule, keep the chain's law; the
    spy shows siblings were taken (the tree did something). Left to right, the blocks do not change the law
    and the decoder runs the answer as one block, so block_length is not varied."""
    block_length = 4
    taken = _branches(monkeypatch)
    law = enumerated_law(model, PROMPT, 4, temperature, "left_to_right", block_length)
    # A milder random head with candidates_below: the sharp one is too sure to get siblings there.
    head = {"draft_head": _random_head(model, scale=3.0 if below is None else 0.5)} if draft == "head" else {}
    out = _sample(model, "fef", 3000, temperature, "left_to_right", block_length, window=window, draft=draft,
                  draft_candidates=candidates, candidates_below=below, **head)
    assert out.exact and sum(taken) > 100 and sum(taken.continued) > (30 if window > 2 else 0)
    assert chi_square_pvalue(out.sequences[:, 3:], law) > ALPHA


def test_a_sibling_whose_queries_do_not_see_it_fails(model, monkeypatch):
    """The test has power: leaf queries that miss their sibling (so the token after it is drawn from the
    target after the chain's prefix instead) are not the chain."""
    import dllm.samplers.fef.two_stream as two_stream

    real = two_stream._Tree.inputs

    def blind(self, *args):
        *inputs, extra = real(self, *args)
        return (*inputs, {**extra, "query_extra": torch.full_like(extra["query_extra"], -1)})

    monkeypatch.setattr(two_stream._Tree, "inputs", blind)
    law = enumerated_law(model, PROMPT, 4, 1.0, "left_to_right", 4)
    out = _sample(model, "fef", 3000, 1.0, "left_to_right", 4, window=4, draft_candidates=2)
    assert chi_square_pvalue(out.sequences[:, 3:], law) < ALPHA


def test_a_branch_whose_queries_see_only_its_sibling_fails(model, monkeypatch):
    """The test has power for the continuations: branch queries that see the sibling but not the
    continuation drafts after it (so the targets there condition on the wrong prefix) are not the chain."""
    import dllm.samplers.fef.two_stream as two_stream

    real = two_stream._Tree.inputs

    def blind(self, *args):
        *inputs, extra = real(self, *args)
        ranges = extra["query_extra"].clone()  # [R, Q, 2]: a branch query's range starts at its sibling
        ranges[..., 1] = torch.minimum(ranges[..., 1], ranges[..., 0] + 1)
        return (*inputs, {**extra, "query_extra": ranges})

    monkeypatch.setattr(two_stream._Tree, "inputs", blind)
    law = enumerated_law(model, PROMPT, 4, 1.0, "left_to_right", 4)
    out = _sample(model, "fef", 20000, 1.0, "left_to_right", 4, window=4, draft_candidates=3)
    assert chi_square_pvalue(out.sequences[:, 3:], law) < ALPHA


@pytest.mark.parametrize("options", [{"draft_candidates": 2}, {"draft_candidates": 3},
                                     {"draft_candidates": 2, "candidates_below": 0.9, "draft": "head"},
                                     {"draft_candidates": VOCAB + 3},
                                     {"draft_candidates": 3, "draft": "head", "window": 8, "max_new_tokens": 4}])
def test_greedy_fef_with_trees_equals_greedy_sequential(model, monkeypatch, options):
    """Token for token, with left padding and EOS stops in the batch (siblings were taken: the spy); more
    candidates than tokens is every token; a window longer than the answer."""
    taken = _branches(monkeypatch)
    prompts = [[1, 3, 0], [2, 1], [0, 1, 3, 3], [3], [2, 2, 1], [0, 3], [1, 1, 1], [3, 0]] * 2
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    head = {"draft_head": _random_head(model)} if options.get("draft") == "head" else {}
    options = {"window": 3, "max_new_tokens": 12, **options}
    common = dict(max_new_tokens=options.pop("max_new_tokens"), temperature=0, eos_token_id=0, block_length=4,
                  attention_mask=mask)
    with torch.no_grad():
        reference = dllm.generate(model, ids, sampler="sequential", **common).sequences
        run = dllm.generate(model, ids, sampler="fef", **options, **head, **common)
        tree, tree_stats = run.sequences, run.stats
    assert torch.equal(reference, tree)
    assert sum(taken) >= 5 and tree_stats.siblings_taken == sum(taken)


@pytest.mark.parametrize("draft", ["marginal", "head"])
def test_after_a_taken_sibling_the_next_window_drafts_from_queries_that_saw_it(model, monkeypatch, draft):
    """After a sibling's branch is accepted to its end, the branch's own lookahead queries become the stored
    draft logits (and, with a head, features): equal to an uncached call that sees every revealed token but
    the pending one (what the chain's lookahead gives after a full window)."""
    import dllm.samplers.fef.two_stream as two_stream

    real, verify, checked, outcomes = two_stream.two_stream_round, two_stream.rejection_sample, [], []

    def spy(*args, **kwargs):
        outcome = verify(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    def checking(state, rows, *args, **kwargs):
        info = real(state, rows, *args, **kwargs)
        outcome = outcomes[-1] if outcomes else None
        for i, row in enumerate(rows.tolist()):
            taken = outcome is not None and outcome.branch is not None and bool(outcome.branch[i])
            done = not bool((state.canvas.x[row] == MASK).any())
            if not taken or outcome.num_accepted[i] < info["num_drafts"][i] or done:
                continue
            x = state.canvas.x[row]
            seen = x != MASK
            seen[int(state.last_col[row])] = False  # the pending token: no stored query saw it
            cols = ((x == MASK) & state.have[row]).nonzero().squeeze(-1)[:3]  # the next window (w3)
            pos = state.positions[row : row + 1]
            with torch.no_grad():
                fresh, features = model.streams(x[None], pos, seen[None], pos[:, cols],
                                                torch.full((1, cols.numel()), x.numel()), hidden=True)
            stored = state.draft_logits[row, cols - state.start]
            torch.testing.assert_close(torch.softmax(forbid_token(fresh[0], MASK), -1), torch.softmax(stored, -1),
                                       atol=1e-5, rtol=1e-4)
            if state.draft_features is not None:
                torch.testing.assert_close(features[0], state.draft_features[row, cols - state.start],
                                           atol=1e-5, rtol=1e-4)
            checked.append(row)
        return info

    monkeypatch.setattr(two_stream, "two_stream_round", checking)
    monkeypatch.setattr(two_stream, "rejection_sample", spy)
    with torch.no_grad():
        head = {"draft": "head", "draft_head": _random_head(model, scale=0.5)} if draft == "head" else {}
        dllm.generate(model, PROMPT[None].expand(64, -1), sampler="fef", max_new_tokens=12, temperature=1.0,
                      generator=torch.Generator().manual_seed(0), eos_token_id=None, window=3, draft_candidates=3,
                      **head)
    assert len(checked) > 20, len(checked)


def test_tree_refusals_name_the_option(model):
    block = TransformerLM(TransformerConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=64,
                                            layout="bidirectional", mask_token_id=MASK)).eval()
    with pytest.raises(ValueError, match="draft_candidates=2 .*verifier='structured' verifies a chain only"):
        _sample(block, "fef", 1, 1.0, "left_to_right", 4, draft_candidates=2, verifier="structured")
    with pytest.raises(ValueError, match="draft_candidates=2 runs with order='left_to_right' only"):
        _sample(model, "fef", 1, 1.0, "confidence", 4, draft_candidates=2)
    with pytest.raises(ValueError, match="candidates_below .*needs draft_candidates > 1"):
        _sample(model, "fef", 1, 1.0, "left_to_right", 4, candidates_below=0.5)
    with pytest.raises(ValueError, match="draft_candidates"):
        _sample(model, "fef", 1, 1.0, "left_to_right", 4, draft_candidates=0)


@pytest.mark.parametrize("options", [{"draft_candidates": 2, "candidates_below": 0.6},
                                     {"draft_candidates": 3, "candidates_below": 0.9, "draft": "head"}])
def test_tree_rows_are_batch_invariant(model, options):
    """With one generator per row, a row's tree draws do not depend on its batch mates, also in rounds where
    some rows have no sibling (candidates_below, or no leaf left) and others do."""
    prompts = [[1, 3, 0], [2, 1], [0, 1, 3, 3], [3], [2, 2, 1], [0, 0]] * 4
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    head = {"draft_head": _random_head(model, scale=0.5)} if options.get("draft") == "head" else {}
    common = dict(sampler="fef", max_new_tokens=10, temperature=1.0, eos_token_id=None, window=3, **options, **head)
    with torch.no_grad():
        batch = dllm.generate(model, ids, attention_mask=mask, **common,
                              generator=[torch.Generator().manual_seed(100 + i) for i in range(len(prompts))])
        for row, prompt in enumerate(prompts):
            alone = dllm.generate(model, torch.tensor([prompt]), **common,
                                  generator=[torch.Generator().manual_seed(100 + row)])
            assert torch.equal(batch.sequences[row, width:], alone.sequences[0, len(prompt):]), row


def test_tree_rounds_are_traced(model, tmp_path):
    """dllm's trace of a tree run: a taken sibling carries the chain's draft it replaced, and the page's
    answer is the row's output."""
    from dllm.eval.study.trace import TraceRecorder, render_trace, trace_rounds

    trace = TraceRecorder()
    with torch.no_grad():
        out = dllm.generate(model, PROMPT[None].expand(8, -1), sampler="fef", max_new_tokens=10, temperature=1.0,
                            generator=torch.Generator().manual_seed(1), eos_token_id=None, window=3,
                            draft_candidates=3, callback=trace)
    taken = [(e, i) for e in trace.events if e.branch is not None for i in (e.branch > 0).nonzero().flatten().tolist()]
    assert taken
    event, i = taken[0]
    row = int(event.rows[i])
    rounds = trace_rounds(trace.events, row=row, mask_token_id=MASK)
    assert any(c.kind == "accepted" and c.note is not None for r in rounds for c in r.cells)
    page = render_trace(trace.events, "abcd", tmp_path / "t.html", row=row, mask_token_id=MASK).read_text()
    assert "".join("abcd"[t] for t in out.sequences[row, 3:].tolist()) in page
