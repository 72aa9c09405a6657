"""The plumbing-depth counter of `dllm.eval.study.call_depth` counts the frames it says it counts."""

from pathlib import Path

import pytest
import torch

from dllm.eval.study.call_depth import main, record_chains


class _Model(torch.nn.Module):
    def forward(self, x):
        return self.forward_cached(x)  # the model calling itself is one entry, not two

    def forward_cached(self, x):
        return x


def _entry(model, x):
    return _hop(model, x) + model.forward_cached(x)


def _hop(model, x):
    return model(x)  # through torch's Module.__call__ frames


def test_hand_built_chains():
    model, x = _Model(), torch.zeros(1)
    here = (str(Path(__file__).resolve()),)
    chains = record_chains(lambda: _entry(model, x), model, entry=_entry.__code__, project=here)
    assert len(chains) == 2 and all(times == 1 for times in chains.values())  # forward's inner call not counted
    via_hop, direct = sorted(chains, key=lambda chain: -chain.depth)
    assert via_hop.frames == ("tests/test_call_depth.py:_hop", "tests/test_call_depth.py:forward")
    assert via_hop.depth == 2 and via_hop.torch_frames >= 1  # Module.__call__'s frames counted apart
    assert direct.frames == ("tests/test_call_depth.py:forward_cached",) and direct.torch_frames == 0


@pytest.mark.parametrize("argv", [[], ["--cache", "none"], ["--sampler", "sequential"], ["--draft", "stale"]])
def test_every_chain_from_generate_to_a_forward_is_at_most_four_calls(capsys, argv):
    """Issue 13's bound: generate -> the loop -> the step (or the draft source) -> the session -> the model."""
    assert main(["--max-new-tokens", "8", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    chains = [line for line in lines if line.startswith("depth ")]
    assert chains and lines[-1].endswith("at most 4")
    assert all(int(line.split()[1]) <= 4 for line in chains), chains
    if not argv:  # fef with the block cache: the copies call and the draft call both reach forward_cached
        copies = ("samplers/fef/round.py:round -> samplers/sessions/block.py:logits -> "
                  "dllm/models/transformer.py:forward_cached")
        assert any(copies in line
                   for line in chains), chains
