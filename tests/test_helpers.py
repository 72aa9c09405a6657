"""The small shared helpers of dllm.numerics (one copy each, used by models, samplers and eval)."""

import pytest
import torch

from dllm.numerics import check_int, left_pad, positions_from_mask


def test_positions_count_real_tokens_from_each_rows_first():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]
    start = torch.tensor([3, 0, 1])
    assert positions_from_mask(mask, start).tolist() == [[3, 3, 3, 4, 5], [0, 1, 2, 3, 4], [1, 1, 1, 2, 3]]


def test_left_pad_right_aligns_rows():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


@pytest.mark.parametrize("value, error", [(True, TypeError), (2.0, TypeError), ("3", TypeError), (0, ValueError)])
def test_check_int_names_the_parameter(value, error):
    with pytest.raises(error, match="steps"):
        check_int("steps", value, minimum=1)
    check_int("steps", 1, minimum=1)


def test_callbacks_receive_a_typed_step_event_that_old_readers_can_index():
    import dllm
    from dllm.stats import StepEvent

    oracle = dllm.HMMOracle.random(num_states=3, num_tokens=5, seed=0)
    seen = []
    dllm.generate(oracle, torch.tensor([[0, 1]]), sampler="fef", max_new_tokens=4, temperature=0, block_length=4,
                  callback=seen.append)
    assert seen and all(isinstance(event, StepEvent) for event in seen)
    assert seen[0]["x"] is seen[0].x and seen[0].sampler == "fef" and seen[0].window is not None
    with pytest.raises(KeyError):
        seen[0]["not_a_field"]
    kept = seen[0].detached()
    assert torch.equal(kept.x, seen[0].x) and kept.x is not seen[0].x
