"""The Drafter interface of ar_spec: hand-built proposals and rollbacks, and a drafter written outside the
package keeping the output law exact (and a dishonest one breaking it, so the check has power)."""

import pytest
import torch

from dllm.models.oracle import HMMOracle
from dllm.numerics import bind_rows, sample_from_logits
from dllm.samplers import sequential_distribution
from dllm.samplers.ar_spec import ar_spec
from dllm.samplers.ar_spec.drafters import CausalDrafter, Draft, DraftContext, Drafter, NgramDrafter
from dllm.stats import DecodeStats

from stat_tools import ALPHA, chi_square_pvalue

PROMPT = torch.tensor([0, 2])
GEN = 4


def context(rows, num_drafts):
    return DraftContext(torch.tensor(rows), torch.tensor(num_drafts), 1.0, torch.Generator().manual_seed(0), 3)


def test_ngram_drafter_proposes_the_latest_continuation_as_point_masses():
    seq = torch.tensor([[1, 2, 3, 1, 2, 0, 0], [4, 5, 6, 7, 0, 0, 0]])
    draft = NgramDrafter(max_ngram=2).propose(seq, torch.tensor([5, 4]), 3, context([0, 1], [2, 3]))
    # Row 0: suffix (1, 2) occurred at 0, followed by 3, 1, 2; cut to its 2 verifiable drafts. Row 1: no match.
    assert draft.tokens[0, :2].tolist() == [3, 1] and draft.count.tolist() == [2, 0] and draft.logits is None


class RecordingCache:
    def __init__(self, length):
        self.length, self.log = length, []

    def select(self, kept):
        self.log.append(("select", kept.tolist()))
        return self

    def crop(self, length):
        self.log.append(("crop", length))
        self.length = min(self.length, length)


def test_causal_drafter_rollback_keeps_rows_and_forgets_entries_that_saw_padding():
    kv = RecordingCache(length=20)
    drafter = CausalDrafter(caller=None, kv=kv)
    drafter._shortest, drafter._width = 9, 4  # as propose records them: min(lengths) and k of the round
    drafter.rollback(torch.tensor([0, 2]), accepted=15)
    # Entries past min(length) + K - 1 = 12 saw padding where the shortest row's last draft went.
    assert kv.log == [("select", [0, 2]), ("crop", 12)]
    drafter.rollback(None, accepted=10)
    assert kv.log[-1] == ("crop", 10)


class FixedDrafter(Drafter):
    """A drafter from outside the package: drafts from fixed logits, whatever the sequence says."""

    def __init__(self, logits, claimed=None):
        self.logits, self.claimed = logits, claimed  # claimed: the logits it reports (dishonest if not its own)

    def propose(self, sequences, lengths, k, ctx):
        logits = self.logits.expand(len(ctx.rows), k, -1)
        flat_rows = ctx.rows.repeat_interleave(k)
        tokens = sample_from_logits(logits.reshape(-1, logits.shape[-1]), ctx.temperature,
                                    bind_rows(ctx.generator, flat_rows)).reshape(len(ctx.rows), k)
        reported = logits if self.claimed is None else self.claimed.expand_as(logits)
        return Draft(tokens, reported, ctx.num_drafts)


@pytest.mark.parametrize("honest", [True, False])
def test_a_new_drafter_keeps_ar_spec_exact_only_with_its_own_logits(honest):
    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0, stickiness=2.0, sharpness=2.0).as_causal()
    assert oracle.vocab_size == 4  # three tokens and a mask id, never to be drafted
    own = torch.tensor([0.3, -0.2, 0.1, -float("inf")])
    claimed = torch.tensor([4.0, -4.0, -4.0, -float("inf")])
    drafter = FixedDrafter(own) if honest else FixedDrafter(own, claimed=claimed)
    stats = DecodeStats()
    out = ar_spec(oracle, PROMPT.expand(12000, -1), GEN, temperature=1.0, generator=torch.Generator().manual_seed(5),
                  stats=stats, drafter=drafter, num_draft_tokens=3)
    pvalue = chi_square_pvalue(out[:, PROMPT.numel():], sequential_distribution(oracle, PROMPT, GEN))
    assert (pvalue > ALPHA) if honest else (pvalue < 1e-6)
    assert 0 < stats.accepted < stats.drafted


class FakeView:
    """The parts of samplers.canvas.View a draft source reads: every position masked from ``first`` on."""

    def __init__(self, offset, active, width=6, rows=(0, 1), first=0):
        self.offset, self.rows, self.calls, self.batch = offset, torch.tensor(rows), 0, 2
        self.x = torch.zeros((len(rows), width), dtype=torch.long)
        self.x[:, first:] = MASK
        self.region = torch.zeros(width, dtype=torch.bool)
        self.region[active] = True
        self.block = (active.start, active.stop)

    def candidates(self, tokens):
        return (tokens == MASK) & self.region

    def call(self, x, rows, at):
        self.calls += 1
        return torch.full((*at.shape, 3), float(self.calls))


MASK = 9


def test_stale_drafts_reuse_the_verified_copy_on_the_moved_band():
    """Stale logits are stored on the round's band (canvas positions from each row's first masked one) and read
    back on the next round's band, shifted by how far it moved; only a row's first round calls the model."""
    from dllm.samplers.fef.sources import MarginalDrafts, StaleDrafts

    source, view = StaleDrafts(window=2), FakeView(offset=2, active=slice(0, 3))  # band: 2W + 2 = 6 positions
    logits, is_state, band = source.logits(view)
    assert is_state and view.calls == 1 and band.width == 6  # nothing stale yet: a call on the state
    verified = torch.arange(2 * 6 * 3, dtype=torch.float).reshape(2, 6, 3)
    source.observe(view, verified, band)
    logits, is_state, _ = source.logits(view)
    assert not is_state and view.calls == 1 and torch.equal(logits, verified)
    shifted = FakeView(offset=5, active=slice(0, 3))  # the next block, three canvas positions on
    logits, is_state, _ = source.logits(shifted)
    assert not is_state and torch.equal(logits[:, :3], verified[:, 3:]) and shifted.calls == 0
    moved = FakeView(offset=2, active=slice(0, 3), first=2)  # two tokens revealed: the band starts two on
    logits, _, band = source.logits(moved)
    assert band.start.tolist() == [2, 2] and torch.equal(logits[:, :4], verified[:, 2:]) and moved.calls == 0
    marginal, again = MarginalDrafts(window=2), FakeView(offset=2, active=slice(0, 3))
    assert not marginal.wants_next and marginal.logits(again)[1] and again.calls == 1  # marginal drafts always call


def test_generate_takes_a_drafter_object_for_ar_spec():
    """A Drafter passes generate's door (issue 14's drafters arrive this way) and runs as ar_spec would run it."""
    import dllm

    oracle = HMMOracle.random(num_states=3, num_tokens=3, seed=0).as_causal()
    own = torch.tensor([0.3, -0.2, 0.1, -float("inf")])
    prompts = PROMPT.expand(4, -1)
    out = dllm.generate(oracle, prompts, sampler="ar_spec", drafter=FixedDrafter(own), num_draft_tokens=3,
                        max_new_tokens=GEN, temperature=1.0, generator=torch.Generator().manual_seed(5),
                        eos_token_id=None)
    direct = ar_spec(oracle, prompts, GEN, temperature=1.0, generator=torch.Generator().manual_seed(5),
                     stats=DecodeStats(), drafter=FixedDrafter(own), num_draft_tokens=3)
    assert torch.equal(out.sequences, direct) and out.options["drafter"] == "FixedDrafter" and out.exact
    assert out.stats.drafted > 0
    with pytest.raises(TypeError, match="a Drafter"):
        dllm.generate(oracle, prompts, sampler="ar_spec", drafter=object(), max_new_tokens=GEN)
