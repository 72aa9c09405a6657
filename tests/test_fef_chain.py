"""Chain windows for the fef head: each slot's target is the verifier's copy on the backbone's own chain."""

import torch
from test_fef_head_training import tiny_backbone

import dllm
from dllm.models.draft_head import DraftHead, DraftHeadConfig
from dllm.training.fef_chain import chain_acceptance, rollout_windows, train_head


def _rollout(model, prompts, temperature, blocks=2):
    return rollout_windows(model, prompts, blocks, temperature, torch.Generator().manual_seed(3), dtype=torch.float32)


def test_greedy_chain_is_sequential_decoding():
    """At T=0 the chain's tokens (window starts of k = 0 states, block by block) are greedy ``sequential``."""
    model = tiny_backbone(vocab=40)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    win = _rollout(model, prompts, 0.0)
    for r, prompt in enumerate(prompts):
        out = dllm.generate(model, torch.tensor([prompt]), sampler="sequential", max_new_tokens=16, temperature=0)
        chain = torch.cat([win.chain[(r + len(prompts) * b) * 8] for b in range(2)])  # k = 0: the whole block
        assert chain.tolist() == out.sequences[0, len(prompt):].tolist()


def test_chain_targets_are_the_verifiers_copies():
    """Window of state k, slot j: features/marginal of the state at s_{k+j}, target = the backbone at
    s_{k+j} with the chain revealed before it (copy j), for ragged prompts and a sampled chain."""
    model = tiny_backbone(vocab=40)
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11]]
    win = _rollout(model, prompts, 1.0)
    for r, prompt in enumerate(prompts):
        tokens = torch.tensor(prompt + torch.cat([win.chain[(r + 2 * b) * 8] for b in range(2)]).tolist())
        start = len(prompt)
        for b in range(2):
            for k in range(8):
                n = (r + 2 * b) * 8 + k  # rows are (block, prompt, k)
                assert int(win.count[n]) == 8 - k
                for j in range(8 - k):
                    s = start + 8 * b + k + j
                    state, copy = tokens[: start + 8 * b + 8].clone(), tokens[: start + 8 * b + 8].clone()
                    state[start + 8 * b + k:] = model.mask_token_id
                    copy[s:] = model.mask_token_id
                    offset = torch.tensor([start])
                    logits, hidden = model(state[None], block_offset=offset, return_hidden=True)
                    target = model(copy[None], block_offset=offset)[0, s]
                    torch.testing.assert_close(win.features[n, j], hidden[0, s])
                    torch.testing.assert_close(win.base[n, j, 3:], logits[0, s, 3:])
                    torch.testing.assert_close(win.targets[n, j, 3:], target[3:])
                    assert int(win.chain[n, j]) == int(tokens[s])


def test_training_on_chain_windows_raises_acceptance():
    """A few hundred cached steps beat the marginals on the windows trained on (the head can learn the chain)."""
    model = tiny_backbone(vocab=40)
    win = _rollout(model, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], 0.0, blocks=3)
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig(vocab_size=40, backbone_dim=32, dim=32, n_heads=2, mask_token_id=2))
    train_head(head, win, "ce", 300, 32, 3e-3, torch.Generator().manual_seed(0), 2, warmup=10, log=lambda s: None)
    acc = chain_acceptance(head.eval(), win, greedy=True)
    assert acc["head"]["expected_accepted_per_window"] > acc["marginal"]["expected_accepted_per_window"] + 0.5


def test_cli_refuses_bad_arguments(capsys):
    """Bad numbers are refused with the parameter named, before any backbone is loaded."""
    from dllm.training.fef_chain import main

    assert main(["--output", "x", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
