"""The draft-head losses: each objective's value and the quantity it trades against (acceptance)."""

import pytest
import torch

from dllm.training.draft_losses import OBJECTIVES, draft_loss, expected_acceptance


def test_acceptance_is_one_minus_total_variation():
    p = torch.tensor([[0.5, 0.3, 0.2]]).log()
    q = torch.tensor([[0.2, 0.3, 0.5]]).log()
    assert expected_acceptance(p, q).item() == pytest.approx(0.7)
    assert draft_loss("tv", p, q).item() == pytest.approx(0.3)
    assert expected_acceptance(q, q).item() == pytest.approx(1.0)


def test_forward_kl_and_reverse_kl_on_known_distributions():
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.9, 0.1]).log()
    forward = 0.9 * torch.log(torch.tensor(0.9 / 0.5)) + 0.1 * torch.log(torch.tensor(0.1 / 0.5))
    reverse = 0.5 * torch.log(torch.tensor(0.5 / 0.9)) + 0.5 * torch.log(torch.tensor(0.5 / 0.1))
    assert draft_loss("ce", p[None], q[None]).item() == pytest.approx(forward.item(), rel=1e-5)
    both = torch.stack([p, p])
    loss = draft_loss("opd", both, torch.stack([q, q]), accepted=torch.tensor([True, False]))
    assert loss.item() == pytest.approx((forward + reverse).item() / 2, rel=1e-5)


def test_a_token_the_target_forbids_costs_nothing_in_forward_kl():
    p = torch.tensor([[0.0, 1.0, 2.0]])
    q = torch.tensor([[float("-inf"), 1.0, 2.0]])
    assert torch.isfinite(draft_loss("ce", p, q))
    assert torch.isfinite(draft_loss("opd", p, q, accepted=torch.tensor([False])))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_raises_acceptance_when_minimised(objective):
    torch.manual_seed(0)
    target = torch.randn(64, 10) * 2
    draft = torch.zeros(64, 10, requires_grad=True)
    before = expected_acceptance(draft, target).mean().item()
    opt = torch.optim.Adam([draft], lr=0.1)
    for _ in range(200):
        accepted = torch.rand(64) < expected_acceptance(draft.detach(), target)
        loss = draft_loss(objective, draft, target, accepted=accepted)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert expected_acceptance(draft, target).mean().item() > before + 0.15


def test_valid_drops_positions_and_bad_objectives_are_named():
    p, q = torch.zeros(2, 3), torch.tensor([[0.0, 0, 0], [5.0, 0, 0]])
    assert draft_loss("tv", p, q, valid=torch.tensor([True, False])).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="objective must be one of"):
        draft_loss("kl", p, q)
    with pytest.raises(ValueError, match="accepted="):
        draft_loss("opd", p, q)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_token_both_sides_forbid_keeps_the_gradient_finite(objective):
    """The mask token is -inf in the draft and the target alike: no objective may turn that into nan."""
    logits = torch.tensor([[float("-inf"), 0.5, -1.0], [float("-inf"), 2.0, 0.0]], requires_grad=True)
    target = torch.tensor([[float("-inf"), 1.0, 0.0], [float("-inf"), -1.0, 1.0]])
    loss = draft_loss(objective, logits, target, accepted=torch.tensor([True, False]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad[:, 1:]).all()
