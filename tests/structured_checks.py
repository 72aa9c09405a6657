"""The check shared by the structured-verifier tests: one pass equals the W + 1 copies it stands for."""

import torch


def assert_structured_equals_copies(model, x, positions, drafts, count, bonus, offset):
    """``model.structured_verify`` row c of row r == the plain model on x with drafts[r, :c] revealed, read at
    positions[r, c] (at bonus[r] for c == count[r]); its state == the plain model on x.

    x [B, L], positions and drafts [B, W], count, bonus and offset [B]; finite entries compared (atol 1e-5).
    """
    with torch.no_grad():
        targets, state = model.structured_verify(x, positions, drafts, count, bonus, block_offset=offset)
        for r in range(x.shape[0]):
            for c in range(int(count[r]) + 1):
                copy = x[r : r + 1].clone()
                copy[0, positions[r, :c]] = drafts[r, :c]
                reference = model(copy, block_offset=offset[r : r + 1])[0]
                at = positions[r, c] if c < count[r] else bonus[r]
                keep = torch.isfinite(reference[at])
                assert torch.allclose(reference[at][keep], targets[r, c][keep], atol=1e-5), (r, c)
        keep = torch.isfinite(state)
        assert torch.allclose(state[keep], model(x, block_offset=offset)[keep], atol=1e-5)
