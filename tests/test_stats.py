"""DecodeStats counted on the device and read once: the same numbers as the per-position loop it replaced, never
stale to a reader, and no synchronisation while counting."""

import copy
import pickle

import pytest
import torch

from dllm.stats import DecodeStats
from dllm.syncs import count_syncs

COUNTERS = ("new_tokens", "rounds", "steps", "drafted", "accepted", "draft_rounds", "undrafted_tokens",
            "siblings_taken", "drafted_per_position", "accepted_per_position")


class LoopStats:
    """The counting DecodeStats did before it moved to the device (a host read per counter and per position)."""

    def __init__(self):
        self.values = dict.fromkeys(COUNTERS[:-2], 0)
        self.values.update(drafted_per_position=[], accepted_per_position=[])

    def count_round(self, emitted):
        self.values["rounds"] += int(emitted.numel())
        self.values["steps"] += 1
        self.values["new_tokens"] += int(emitted.sum())

    def count_verification(self, num_drafts, num_accepted, num_emitted, branch=None):
        v = self.values
        self.count_round(num_emitted)
        if branch is not None:
            v["siblings_taken"] += int((branch > 0).sum())
        v["drafted"] += int(num_drafts.sum())
        v["accepted"] += int(num_accepted.sum())
        drafting = num_drafts > 0
        v["draft_rounds"] += int(drafting.sum())
        v["undrafted_tokens"] += int(num_emitted[~drafting].sum())
        width = int(num_drafts.max()) if num_drafts.numel() else 0
        for name in ("drafted_per_position", "accepted_per_position"):
            v[name].extend([0] * (width - len(v[name])))
        for j in range(width):
            v["drafted_per_position"][j] += int((num_drafts > j).sum())
            v["accepted_per_position"][j] += int((num_accepted > j).sum())


def random_rounds(seed: int, count: int = 30):
    """Ragged verification rounds (and plain steps): rows, windows, acceptances and branches drawn at random."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        rows = int(torch.randint(0, 5, (), generator=g))
        window = int(torch.randint(0, 9, (), generator=g))
        num_drafts = torch.randint(0, window + 1, (rows,), generator=g)
        num_accepted = (torch.rand(rows, generator=g) * (num_drafts + 1)).long().clamp(max=num_drafts)
        num_emitted = num_accepted + torch.randint(0, 2, (rows,), generator=g)
        branch = torch.randint(0, 3, (rows,), generator=g) if bool(torch.rand((), generator=g) < 0.5) else None
        kind = int(torch.randint(0, 3, (), generator=g))
        yield kind, window, num_drafts, num_accepted, num_emitted, branch


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pass_width", [True, False])
def test_device_counts_equal_the_per_position_loop(seed, pass_width):
    stats, loop = DecodeStats(), LoopStats()
    for kind, window, num_drafts, num_accepted, num_emitted, branch in random_rounds(seed):
        if kind == 0:
            stats.count_round(num_emitted)
            loop.count_round(num_emitted)
        else:
            extra = {"width": window} if pass_width else {}
            stats.count_verification(num_drafts, num_accepted, num_emitted, branch, **extra)
            loop.count_verification(num_drafts, num_accepted, num_emitted, branch)
    assert {name: getattr(stats, name) for name in COUNTERS} == loop.values


def test_counting_never_synchronises_and_settling_reads_once():
    stats = DecodeStats()
    rounds = list(random_rounds(0))
    with count_syncs(as_gpu=True) as syncs:
        for _, window, num_drafts, num_accepted, num_emitted, branch in rounds:
            stats.count_verification(num_drafts, num_accepted, num_emitted, branch, width=window)
            stats.count_round(num_emitted)
    assert syncs.count == 0, syncs.by_op
    with count_syncs(as_gpu=True) as syncs:
        stats.settle()
        stats.settle()  # nothing pending: no read
        _ = (stats.new_tokens, stats.acceptance_per_position, stats.to_dict())
    assert dict(syncs.by_op) == {"tolist": 1}


def test_without_width_one_read_of_the_largest_draft_count_per_round():
    stats, counts = DecodeStats(), (torch.tensor([2, 3]), torch.tensor([1, 3]), torch.tensor([2, 4]))
    with count_syncs(as_gpu=True) as syncs:  # (counts made before: device tensors)
        stats.count_verification(*counts)
    assert dict(syncs.by_op) == {"__int__": 1}
    assert (stats.drafted_per_position, stats.accepted_per_position) == ([2, 2, 1], [2, 1, 1])


def test_every_reader_sees_settled_counts():
    def counted():
        stats = DecodeStats(nfe=3, drafted_per_position=[1, 1, 1, 1], accepted_per_position=[1, 0, 0, 0])
        stats.count_verification(torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([2, 1]), width=4)
        return stats

    expected = {"new_tokens": 3, "rounds": 2, "steps": 1, "drafted": 2, "accepted": 1, "draft_rounds": 1,
                "undrafted_tokens": 1, "drafted_per_position": [2, 2, 1, 1], "accepted_per_position": [2, 0, 0, 0]}
    readers = {
        "attributes": lambda s: {k: getattr(s, k) for k in expected},
        "to_dict": lambda s: {k: s.to_dict()[k] for k in expected},
        "sum": lambda s: {k: getattr(s + DecodeStats(), k) for k in expected},
        "copy": lambda s: {k: getattr(copy.copy(s), k) for k in expected},
        "pickle": lambda s: {k: getattr(pickle.loads(pickle.dumps(s)), k) for k in expected},
        "equality": lambda s: expected if s == counted().settle() else None,
    }
    for name, read in readers.items():
        assert read(counted()) == expected, name
    stats = counted()
    assert (stats.mean_acceptance_length, stats.acceptance_rate, stats.tokens_per_call) == (1.5, 0.5, 1.0)
    assert stats.acceptance_per_position == [1.0, 0.0, 0.0, 0.0]


def test_writing_a_counter_replaces_what_was_pending():
    """generate sets ``new_tokens`` to the tokens up to each row's stop: the pending count must not add on top."""
    stats = DecodeStats()
    stats.count_round(torch.tensor([4, 4]))
    stats.new_tokens = 5
    assert stats.new_tokens == 5
    stats.count_round(torch.tensor([1]))
    stats.new_tokens += 1  # read (settled: 6) then written
    assert stats.new_tokens == 7


def test_copies_do_not_share_pending_counts():
    stats = DecodeStats()
    stats.count_round(torch.tensor([2]))
    twin = copy.copy(stats)
    stats.count_round(torch.tensor([3]))
    assert (twin.new_tokens, stats.new_tokens) == (2, 5)


def test_empty_rounds_count_rows_and_steps_only():
    stats = DecodeStats()
    empty = torch.zeros(0, dtype=torch.long)
    stats.count_verification(empty, empty, empty, width=4)
    stats.count_round(empty)
    assert (stats.rounds, stats.steps, stats.new_tokens, stats.drafted_per_position) == (0, 2, 0, [])
