"""The fef-head recipe: its targets are the verifier's copies, its losses train, its folders load as heads."""

import json
import shutil

import torch

import dllm
from dllm.models.draft_head import DraftHead
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.train import main as train_main
from dllm.training.fef_head import FefHeadConfig, Windows, copy_targets, train, train_step


def tiny_backbone(vocab=495, seed=0):
    """A random block-causal model shaped like the shipped one (blocks of 8), small enough to train on."""
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, max_seq_len=256,
                               layout="block_causal", block_size=8, mask_token_id=2, eos_token_id=1, pad_token_id=0)
    return TransformerLM(config).eval().requires_grad_(False)


def test_copy_targets_are_the_verifiers_copies():
    """Slot c's target is the backbone at s_c on the state with drafts d_<c revealed, one call per copy."""
    model = tiny_backbone(vocab=40)
    state = torch.tensor([[5, 6, 7, 8, 2, 2, 2, 2, 2, 2, 2, 2], [9, 9, 9, 11, 12, 13, 14, 2, 2, 2, 2, 2]])
    offset = torch.tensor([4, 3])
    positions = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9, 10, 0, 0, 0, 0]])
    count = torch.tensor([8, 4])
    drafts = torch.randint(3, 40, (2, 8))
    logits, features = model(state, block_offset=offset, return_hidden=True)
    rows = torch.arange(2)[:, None]
    win = Windows(state, offset, positions, count, drafts, logits[rows, positions], features[rows, positions])
    targets = copy_targets(model, win, drafts)
    for r in range(2):
        for c in range(int(count[r])):
            copy = state[r].clone()
            copy[positions[r, :c]] = drafts[r, :c]
            expected = model(copy[None], block_offset=offset[r : r + 1])[0, positions[r, c]]
            torch.testing.assert_close(targets[r, c], expected)


def test_opd_step_has_finite_gradients():
    """Reverse KL over a vocabulary whose mask token is -inf in both laws must not poison the head with NaN."""
    model = tiny_backbone(vocab=40)
    state = torch.tensor([[5, 6, 7, 8, 2, 2, 2, 2, 2, 2, 2, 2]])
    offset, positions = torch.tensor([4]), torch.arange(4, 12)[None]
    with torch.no_grad():
        logits, features = model(state, block_offset=offset, return_hidden=True)
    win = Windows(state, offset, positions, torch.tensor([8]), torch.randint(3, 40, (1, 8)), logits[0, 4:][None],
                  features[0, 4:][None])
    head = DraftHead(dllm.models.draft_head.DraftHeadConfig(vocab_size=40, backbone_dim=32, dim=16, n_heads=2,
                                                            mask_token_id=2))
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    for _ in range(3):
        train_step(head, model, optimizer, "opd", win, torch.Generator().manual_seed(0))
    assert all(torch.isfinite(p).all() for p in head.parameters())


def test_recipe_trains_heads_that_generate_uses(tmp_path):
    backbone = tmp_path / "backbone"
    tiny_backbone().save_pretrained(backbone)
    shutil.copy("dllm/weights/diffusion/tokenizer.json", backbone / "tokenizer.json")
    config = FefHeadConfig(backbone=str(backbone), steps=3, batch_size=2, dim=16, n_heads=2, eval_problems=2)
    reports = train(config, tmp_path / "heads", ("ce", "tv", "opd"), log=lambda line: None)
    assert sorted(reports) == ["ce", "opd", "tv"]
    for objective, report in reports.items():
        assert len(report["losses"]) == 3 and all(map(lambda v: v == v, report["losses"]))  # no NaN
        saved = json.loads((tmp_path / "heads" / objective / "train.json").read_text())
        assert saved["config"]["objective"] == objective
    model = TransformerLM.from_pretrained(backbone)
    prompt = torch.tensor([[3, 10, 11, 12]])
    common = dict(sampler="fef", max_new_tokens=16, temperature=0.0, window=8)
    head = dllm.generate(model, prompt, draft="head", draft_head=str(tmp_path / "heads" / "tv"), **common)
    assert torch.equal(head.sequences, dllm.generate(model, prompt, sampler="sequential", max_new_tokens=16,
                                                     temperature=0.0).sequences)


def test_recipe_refuses_bad_arguments(capsys):
    assert train_main(["--recipe", "fef-head", "--set", "stepz=3", "--output", "unused"]) == 2
    assert "--set expects KEY=VALUE with KEY one of" in capsys.readouterr().err
    assert train_main(["--recipe", "fef-head", "--set", "suffix_prob=2", "--output", "unused"]) == 2
    assert "suffix_prob must lie in [0, 1]" in capsys.readouterr().err
