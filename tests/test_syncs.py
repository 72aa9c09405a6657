"""The host out of the loop: the synchronisation counter (dllm.syncs), noise drawn on the tensors' device
(dllm.numerics.generator_on, draw_seed), and verification that reads nothing on the host where it need not."""

import pytest
import torch

from dllm import numerics
from dllm.kernels.verify import Noise, verify_logits_reference
from dllm.numerics import RowGenerators, draw_seed, generator_on, sample_from_logits, uniform
from dllm.syncs import count_syncs

# --------------------------------------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------------------------------------

X = torch.arange(6.0)  # made before any counted region: device tensors under as_gpu
MASK = X > 2
REPEATS = torch.ones(6, dtype=torch.long)
INDEX = torch.tensor([0, 2])

SYNCING = {  # op -> (call, the label it is counted under)
    "item": (lambda: X[0].item(), "item"),
    "tolist": (lambda: X.tolist(), "tolist"),
    "bool": (lambda: bool(MASK[0]), "__bool__"),
    "if": (lambda: 1 if X.sum() > 0 else 0, "__bool__"),
    "int": (lambda: int(X[1]), "__int__"),
    "float": (lambda: float(X[1]), "__float__"),
    "index": (lambda: [1, 2, 3][INDEX[1]], "__index__"),
    "format": (lambda: f"{X[1]:.2f}", "__format__"),
    "contains": (lambda: 3.0 in X, "__contains__"),
    "numpy": (lambda: X.numpy(), "numpy"),
    "equal": (lambda: torch.equal(X, X), "equal"),
    "nonzero": (lambda: torch.nonzero(MASK), "nonzero"),
    "nonzero method as_tuple": (lambda: MASK.nonzero(as_tuple=True), "nonzero"),
    "argwhere": (lambda: torch.argwhere(MASK), "argwhere"),
    "where one argument": (lambda: torch.where(MASK), "where (one argument)"),
    "unique": (lambda: torch.unique(X), "unique"),
    "unique method": (lambda: X.unique(), "unique"),
    "unique_consecutive": (lambda: torch.unique_consecutive(X), "unique_consecutive"),
    "masked_select": (lambda: torch.masked_select(X, MASK), "masked_select"),
    "bincount": (lambda: torch.bincount(INDEX), "bincount"),
    "repeat_interleave": (lambda: torch.repeat_interleave(X, REPEATS),
                          "repeat_interleave (tensor repeats, no output_size)"),
    "one_hot": (lambda: torch.nn.functional.one_hot(INDEX), "one_hot (no num_classes)"),
    "getitem bool": (lambda: X[MASK], "__getitem__ (bool mask)"),
    "getitem bool in tuple": (lambda: X[None][:, MASK], "__getitem__ (bool mask)"),
    "setitem bool, tensor value": (lambda: X.clone().__setitem__(MASK, X[0]), "__setitem__ (bool mask)"),
    "index_put_ bool": (lambda: X.clone().index_put_((MASK,), X[0]), "index_put (bool mask)"),
    "cpu": (lambda: X.cpu(), "cpu (device->host)"),
    "to cpu": (lambda: X.to("cpu"), "to (device->host)"),
    "tensor onto the device": (lambda: torch.tensor([1, 2], device=X.device), "tensor (host->device)"),
    "host tensor onto the device": (lambda: torch.as_tensor(torch.tensor([1]), device=X.device),
                                    "as_tensor (host->device)"),
    "host index": (lambda: X[torch.tensor([0, 1])], "__getitem__ (host index)"),
    "list index": (lambda: X[[0, 1]], "__getitem__ (host index)"),
    "host value": (lambda: X.clone().__setitem__(slice(0, 2), torch.tensor([1.0, 2.0])), "__setitem__ (host value)"),
    "slice bound": (lambda: X[: INDEX[1]], "__getitem__ (tensor slice bound)"),
    "factory reads a number": (lambda: torch.arange(INDEX[1]), "arange (tensor as a number)"),
}

NOT_SYNCING = {
    "arithmetic": lambda: (X * 2 + 1).exp().sum(),
    "argmax": lambda: X.argmax(),
    "gather": lambda: X.gather(0, INDEX),
    "where": lambda: torch.where(MASK, X, 0.0),
    "multinomial": lambda: torch.multinomial(X + 1, 2, generator=torch.Generator().manual_seed(0)),
    "any / cumsum / sort / topk": lambda: (MASK.any(), X.cumsum(0), X.sort(), X.topk(2)),
    "shape reads": lambda: (X.shape, X.shape[0], X.numel(), X.size(0), X.dim(), len(X), X.dtype, X.device),
    "setitem bool, number": lambda: X.clone().__setitem__(MASK, 1.0),
    "index and slices": lambda: (X[INDEX], X[1:3], X[None, 2], X[..., 0]),
    "repeat_interleave output_size": lambda: torch.repeat_interleave(X, REPEATS, output_size=6),
    "one_hot num_classes": lambda: torch.nn.functional.one_hot(INDEX, num_classes=6),
    "factories on the device": lambda: (torch.arange(4, device=X.device), torch.full((2,), 3, device=X.device)),
    "randperm": lambda: torch.randperm(5, device=X.device),
    "host tensors read on the host": lambda: (torch.tensor([1, 2]).sum().item(), torch.arange(3).tolist(),
                                              int(torch.zeros((), dtype=torch.long) + 4)),
    "host bool mask": lambda: X[torch.tensor([True, False] * 3)],
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_synchronising_op_counts_once(name):
    call, label = SYNCING[name]
    with count_syncs(as_gpu=True) as syncs:
        call()
    assert (syncs.count, dict(syncs.by_op)) == (1, {label: 1})


@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_ops_that_do_not_synchronise_are_not_counted(name):
    with count_syncs(as_gpu=True) as syncs:
        NOT_SYNCING[name]()
    assert syncs.count == 0, syncs.by_op


def test_cpu_tensors_count_only_as_if_on_a_gpu():
    with count_syncs(as_gpu=False) as syncs:
        for call, _ in SYNCING.values():
            call()
    assert syncs.count == 0, syncs.by_op


def test_a_copy_to_the_host_is_a_host_tensor_and_its_source_stays_on_the_device():
    with count_syncs(as_gpu=True) as syncs:
        moved = X.cpu()  # on a CPU ``cpu()`` returns the tensor itself: an alias stands for the copy
        moved.sum().item()  # host: no sync
        X.sum().item()  # still the device
        back = moved.to(X.device)  # a torch.device: the accelerator
        back.sum().item()
    assert dict(syncs.by_op) == {"cpu (device->host)": 1, "item": 2, "to (host->device)": 1}
    assert moved is not X and torch.equal(moved, X)


def test_contexts_nest_and_pause():
    with count_syncs(as_gpu=True) as outer:
        X[0].item()
        with count_syncs(as_gpu=True) as inner:
            bool(MASK[1])
            with inner.paused(), outer.paused():
                X.tolist()
        X.nonzero()
    assert (outer.count, inner.count) == (3, 1)
    assert dict(outer.by_op) == {"item": 1, "__bool__": 1, "nonzero": 1} and dict(inner.by_op) == {"__bool__": 1}


def test_sites_name_the_line_that_synchronised():
    with count_syncs(as_gpu=True, stacks=True) as syncs:
        X[0].item()
    [site] = syncs.sites
    assert site.startswith("item at ") and "test_syncs.py" in site and "test_sites_name_the_line" in site


def test_nothing_is_installed_outside_the_region():
    with count_syncs(as_gpu=True):
        assert torch._C._is_torch_function_mode_enabled()
    assert not torch._C._is_torch_function_mode_enabled()


def test_default_counts_as_if_on_a_gpu_only_without_cuda():
    with count_syncs() as syncs:
        pass
    assert syncs.as_gpu == (not torch.cuda.is_available())


# --------------------------------------------------------------------------------------------------------
# Noise on the tensors' device
# --------------------------------------------------------------------------------------------------------


def test_same_device_noise_is_drawn_as_before():
    """CPU generator, CPU tensors: the generator itself, so seeds give the samples they always gave."""
    generator = torch.Generator().manual_seed(5)
    assert generator_on(generator, "cpu") is generator
    expected = torch.rand((3, 4), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(uniform(torch.Generator().manual_seed(5), (3, 4), torch.device("cpu")), expected)
    rows = RowGenerators([torch.Generator().manual_seed(i) for i in range(3)])
    bound = rows.bind(torch.tensor([2, 0]))
    expected = torch.stack([torch.rand(4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                            for i in (2, 0)])
    assert torch.equal(uniform(bound, (2, 4), "cpu"), expected)


def test_a_generator_elsewhere_seeds_one_on_the_tensors_device(monkeypatch):
    """The conversion (tested on the CPU by making every device look foreign): one seed from the generator per
    draw, the noise then drawn on the tensors' device from a generator seeded with it; replayable."""
    monkeypatch.setattr(numerics, "_same_device", lambda a, b: False)
    source = torch.Generator().manual_seed(11)
    seed = draw_seed(torch.Generator().manual_seed(11))
    noise = uniform(source, (2, 3), "cpu")
    assert torch.equal(noise, torch.rand((2, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    follower = torch.Generator().manual_seed(11)
    draw_seed(follower)  # the source moved on by exactly one seed
    assert torch.equal(source.get_state(), follower.get_state())
    assert torch.equal(uniform(torch.Generator().manual_seed(11), (2, 3), "cpu"), noise)  # replays


def test_a_device_with_no_generator_is_refused_naming_the_parameter():
    with pytest.raises(ValueError, match=r"^generator: noise for tensors on meta .* pass a torch.Generator"):
        uniform(torch.Generator().manual_seed(0), (2, 3), "meta")


class _PhiloxState:
    """What draw_seed reads of an accelerator's generator: its host-side seed and offset."""

    def __init__(self, seed: int, offset: int = 0):
        self.device, self.seed, self.offset = torch.device("cuda", 0), seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def test_an_accelerator_generator_gives_a_seed_from_its_host_state():
    first, again = _PhiloxState(7), _PhiloxState(7)
    seeds = [draw_seed(first), draw_seed(first)]
    assert first.offset == 8 and seeds[0] != seeds[1]  # moved on by a draw's 4 each time
    assert draw_seed(again) == seeds[0]  # a pure function of (seed, offset): replays
    assert draw_seed(_PhiloxState(8)) != seeds[0]
    assert all(0 <= s < 2**63 for s in seeds)


def test_a_cpu_generator_draws_its_seed_as_before():
    generator = torch.Generator().manual_seed(3)
    expected = int(torch.randint(0, 2**63 - 1, (), generator=torch.Generator().manual_seed(3)).item())
    with count_syncs(as_gpu=True) as syncs:
        seed = draw_seed(generator)
    assert seed == expected and syncs.count == 0  # a host draw, read on the host


def test_per_row_generators_bind_on_the_rows_device_and_read_them_once_per_draw():
    rows, pick = RowGenerators([torch.Generator().manual_seed(i) for i in range(4)]), torch.tensor([1, 0])
    with count_syncs(as_gpu=True) as syncs:
        bound = rows.bind(INDEX).bind(pick)  # rows 2, 0
        draws = [bound.rand((2, 3), "cpu"), bound.rand((2, 3), "cpu")]
    assert syncs.by_op == {"tolist": 1}  # binding reads nothing; the rows are read once for both draws
    fresh = [torch.Generator().manual_seed(i) for i in range(4)]
    expected = [torch.stack([torch.rand(3, generator=fresh[r], dtype=torch.float64) for r in (2, 0)])
                for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(draws, expected))


def test_sampling_from_a_generator_reads_nothing():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    with count_syncs(as_gpu=True) as syncs:
        sample_from_logits(logits, 1.0, torch.Generator().manual_seed(1))
    assert syncs.count == 0, syncs.by_op


# --------------------------------------------------------------------------------------------------------
# Verification without reads
# --------------------------------------------------------------------------------------------------------


def _round(batch=4, width=3, vocab=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(batch, width, vocab, generator=g)
    target_logits = torch.randn(batch, width + 1, vocab, generator=g)
    drafts = torch.randint(vocab, (batch, width), generator=g)
    num_drafts = torch.tensor([3, 0, 2, 1])[:batch]
    has_bonus = torch.tensor([True, False, True, False])[:batch]
    return drafts, draft_logits, target_logits, num_drafts, has_bonus


@pytest.mark.parametrize("noise", ["greedy", "seed", "explicit"])
def test_verification_reads_nothing_with_greedy_counter_or_explicit_noise(noise):
    drafts, draft_logits, target_logits, num_drafts, has_bonus = _round()
    kwargs = {"greedy": {"temperature": 0.0, "noise": Noise(seed=1)},
              "seed": {"temperature": 1.0, "noise": Noise(seed=1)},
              "explicit": {"temperature": 1.0,
                           "noise": Noise(uniforms=torch.rand(4, 3, dtype=torch.float64),
                                          gumbels=-torch.log(-torch.log(torch.rand(4, 6, dtype=torch.float64))))},
              }[noise]
    with count_syncs(as_gpu=True) as syncs:
        verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, has_bonus=has_bonus, **kwargs)
    assert syncs.count == 0, syncs.by_op


def test_verification_with_a_generator_reads_once():
    """A generator's draws must go to the rows that draw (so rows that draw nothing consume nothing): one read."""
    drafts, draft_logits, target_logits, num_drafts, has_bonus = _round()
    with count_syncs(as_gpu=True) as syncs:
        verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, has_bonus=has_bonus,
                                temperature=1.0, noise=Noise(generator=torch.Generator().manual_seed(2)))
    assert dict(syncs.by_op) == {"nonzero": 1}


@pytest.mark.parametrize("seed", range(10))
def test_reading_nothing_emits_what_drawing_the_extra_rows_alone_emitted(seed, monkeypatch):
    """Drawing every row and masking the write equals drawing the rows that need a token alone (the generator
    path's way, forced here): greedy, counter and explicit noise are pure functions of the row."""
    from dllm.kernels import verify as verify_module

    drafts, draft_logits, target_logits, num_drafts, has_bonus = _round(seed=seed)
    uniforms = torch.rand(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    gumbels = -torch.log(-torch.log(uniforms))
    cases = [(0.0, {"seed": seed}), (1.0, {"seed": seed}), (0.7, {"gumbels": gumbels, "seed": seed})]
    fast = [verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, has_bonus=has_bonus,
                                    temperature=t, **noise) for t, noise in cases]
    monkeypatch.setattr(verify_module, "_extra_rows", lambda extra, noise, greedy: extra.nonzero().squeeze(-1))
    alone = [verify_logits_reference(drafts, draft_logits, target_logits, num_drafts, has_bonus=has_bonus,
                                     temperature=t, **noise) for t, noise in cases]
    for a, b in zip(fast, alone):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_emitted, b.num_emitted)
