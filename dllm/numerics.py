"""Numerical rules shared by every sampler and kernel, each with the reason it exists.

- Probabilities come from logits through a max-subtracted softmax in float32 or wider: bf16 logits
  lose the small probabilities that acceptance ratios divide by.
- Sampling noise (uniforms, Gumbel) is float64: LLaDA's reference sampler uses float64 Gumbel noise,
  and low-precision noise measurably biases masked-diffusion sampling (ties and truncated tails).
- Categorical samples are Gumbel-max over ``log(weights) + gumbel`` in float64, so a zero weight (or a
  ``-inf`` logit) can never be drawn.
- Greedy is ``argmax`` of the logits; ties go to the lowest token id (torch's documented argmax rule),
  so two samplers that see the same logits pick the same token.
- Never a [B, L, V] float64 tensor at real vocabulary sizes: noise is drawn in row chunks of at most
  ``NOISE_CHUNK_ELEMENTS`` entries.
- Every random draw takes an explicit ``torch.Generator`` (or ``RowGenerators``, one per batch row);
  there is no global RNG in sampling code.
- Noise is drawn on the device of the tensors it meets (``generator_on``): float64 noise never crosses devices,
  and drawing it never waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NOISE_CHUNK_ELEMENTS = 1 << 23  # 64 MB of float64 noise at most per chunk
SEED_LIMIT = 1 << 63  # seeds are int64 >= 0 (the counter-based noise's Philox key is their two 32-bit halves)
_MASK64 = (1 << 64) - 1


def softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 (or wider) probabilities of ``logits / temperature`` along the last axis; temperature > 0."""
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        scores = scores / temperature
    return torch.softmax(scores, dim=-1)


class RowGenerators:
    """One torch.Generator per batch row, so a row's noise never depends on the rest of the batch.

    Samplers ``bind`` it to the batch row of every leading index of the next draw (``rows`` [N]); each
    index then draws its share from its own row's generator. Binding composes: ``bind(i)`` of a bound
    object picks ``rows[i]``. Binding stays on the rows' device; a draw reads the rows once (it must know
    which generator serves which index), so a bound object costs one read however often it draws.
    """

    def __init__(self, generators: Sequence[torch.Generator], rows: torch.Tensor | None = None):
        self.generators = list(generators)
        self.rows = None if rows is None else rows.detach().long().clone()  # None: index i is row i
        self._host_rows: list[int] | None = None

    @property
    def device(self) -> torch.device:
        return self.generators[0].device

    def bind(self, index: torch.Tensor) -> RowGenerators:
        return RowGenerators(self.generators, index if self.rows is None else self.rows[index.to(self.rows.device)])

    def rand(self, shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
        """float64 uniforms [N, *shape[1:]] on ``device`` (default: the generators'): index i drawn from the
        generator of row ``rows[i]``."""
        device = self.device if device is None else device
        count = len(self.generators) if self.rows is None else self.rows.shape[0]
        if shape[0] != count:
            raise ValueError(f"RowGenerators bound to {count} rows cannot draw shape {shape}")
        if not count:
            return torch.empty(shape, dtype=torch.float64, device=device)
        if self._host_rows is None:
            self._host_rows = list(range(count)) if self.rows is None else self.rows.tolist()
        return torch.stack([torch.rand(shape[1:], generator=generator_on(self.generators[r], device),
                                       dtype=torch.float64, device=device) for r in self._host_rows])


Generator = torch.Generator | RowGenerators


def bind_rows(generator: Generator, rows: torch.Tensor) -> Generator:
    """``generator`` restricted to draws whose leading index i belongs to batch row ``rows[i]``."""
    return generator.bind(rows) if isinstance(generator, RowGenerators) else generator


def draw_seed(generator: torch.Generator) -> int:
    """One seed in [0, 2^63) from ``generator``, without waiting for a device: how a kernel (and ``generator_on``)
    turns a generator into replayable noise.

    A CPU generator draws it. An accelerator's generator (CUDA's Philox) gives it from its host-side state,
    (seed, offset) mixed by SplitMix64 (Steele et al. 2014), and moves its offset on by one draw's 4 so the next
    call differs: drawing on the device and reading the number back would stall the host once per call.
    """
    if generator.device.type == "cpu":  # (device named "cpu": a host draw, to dllm.syncs too)
        return int(torch.randint(0, SEED_LIMIT - 1, (), generator=generator, device="cpu").item())
    try:
        offset = generator.get_offset()
    except (AttributeError, RuntimeError, NotImplementedError):  # no host-side offset: draw there and read (a sync)
        return int(torch.randint(0, SEED_LIMIT - 1, (), generator=generator, device=generator.device).item())
    generator.set_offset(offset + 4)
    return _splitmix64((generator.initial_seed() * 0x9E3779B97F4A7C15 + offset) & _MASK64) >> 1


def _splitmix64(value: int) -> int:
    """SplitMix64's output function of a 64-bit value (Steele, Lea and Flood 2014)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def generator_on(generator: torch.Generator, device: torch.device | str) -> torch.Generator:
    """``generator`` when it draws on ``device``; else a generator there, seeded by one ``draw_seed`` from it.

    Why a conversion and not an error: the README, the CLI and bench pass ``torch.Generator()`` (a CPU one) with
    inputs on any device. Before, their float64 noise was drawn on the CPU and copied over (up to 64 MB a chunk,
    and a copy that waits for the device); now it is drawn where the tensors are, still replayed exactly from
    the generator's state, at the cost of one host-side seed per draw (what the Triton kernels pay). On its own
    device the generator is used as is: CPU runs draw exactly what they always drew.
    """
    device = torch.device(device)
    if _same_device(generator.device, device):
        return generator
    seed = draw_seed(generator)
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError as error:
        raise ValueError(f"generator: noise for tensors on {device} is drawn on {device}, where no torch.Generator "
                         f"can live ({error}); pass a torch.Generator on the inputs' device or the CPU, or explicit "
                         "noise") from None


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device; an index left out (``torch.device("cuda")``) matches any index of its type."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def uniform(generator: Generator, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """float64 uniforms in [0, 1) drawn from ``generator`` on ``device`` (``generator_on``)."""
    if isinstance(generator, RowGenerators):
        return generator.rand(shape, device)
    return torch.rand(shape, generator=generator_on(generator, device), dtype=torch.float64, device=device)


def gumbel(generator: torch.Generator, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """float64 standard Gumbel noise; u = 0 maps to -inf, which only ever loses an argmax."""
    return -torch.log(-torch.log(uniform(generator, shape, device)))


def gumbel_argmax(log_weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample one index per row of ``log_weights`` [N, V] (unnormalised log-probabilities) -> [N].

    Rows are processed in chunks so the float64 noise never exceeds NOISE_CHUNK_ELEMENTS entries.
    """
    out = torch.empty(log_weights.shape[0], dtype=torch.long, device=log_weights.device)
    for start, scores in _gumbel_chunks(log_weights, generator):
        out[start : start + scores.shape[0]] = scores.argmax(-1)
    return out


def _gumbel_chunks(log_weights: torch.Tensor, generator: torch.Generator):
    """(first row, float64 log_weights + Gumbel noise) over row chunks of ``log_weights`` [N, V], each chunk's
    noise at most NOISE_CHUNK_ELEMENTS entries, row i drawn from the generator bound to i (``bind_rows``)."""
    n, vocab = log_weights.shape
    chunk = max(1, NOISE_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n, chunk):
        rows = log_weights[start : start + chunk].double()
        part = generator  # per-row generators: bound to the chunk's rows, on their device (no copy of the index)
        if isinstance(generator, RowGenerators):
            part = generator.bind(torch.arange(start, start + rows.shape[0], device=rows.device))
        yield start, rows + gumbel(part, tuple(rows.shape), rows.device)


def sample_from_logits(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] from softmax(logits / T); T = 0 is greedy -> [N]."""
    if temperature == 0:
        return logits.argmax(-1)
    return gumbel_argmax(logits.float() / temperature, generator)


def sample_more(logits: torch.Tensor, taken: torch.Tensor, count: int, temperature: float,
                generator: torch.Generator) -> torch.Tensor:
    """``count`` more draws per row of ``logits`` [N, V] without replacement, after ``taken`` [N] was drawn
    -> [N, count] long, -1 where the law has no token left (forbidden tokens are never drawn).

    Draw i is distributed as softmax(logits / T) with ``taken`` and draws 0..i-1 removed and renormalised
    (the Gumbel-top-k race, Kool et al. 2019); T = 0 takes the next-highest logits, ties to the lower id.
    """
    out = torch.full((logits.shape[0], count), -1, dtype=torch.long, device=logits.device)
    width = min(count, logits.shape[1])  # more draws than tokens: the rest are -1
    scored = _gumbel_chunks(logits.double() / temperature, generator) if temperature > 0 else [(0, logits.double())]
    for start, scores in scored:
        rows = slice(start, start + scores.shape[0])
        scores = scores.scatter(1, taken[rows, None], float("-inf"))
        values, order = torch.sort(scores, dim=1, descending=True, stable=True)
        out[rows, :width] = torch.where(torch.isneginf(values[:, :width]), -1, order[:, :width])
    return out


def sample_from_probs(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of non-negative ``weights`` [N, V] (need not sum to 1) -> [N]."""
    return gumbel_argmax(torch.log(weights.double()), generator)


def forbid_token(logits: torch.Tensor, token_id: int | None) -> torch.Tensor:
    """``logits`` with ``token_id`` set to -inf (a sampler never emits the mask token); not in place."""
    if token_id is None or token_id >= logits.shape[-1]:
        return logits
    logits = logits.clone()
    logits[..., token_id] = float("-inf")
    return logits


# Small shared helpers (one copy each: a second copy is where the next bug lives).


def positions_from_mask(attention_mask: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """Position ids counting real tokens only, ``start`` at each row's first one (HF generate's rule).

    ``attention_mask`` [B, L] is 1 on real tokens; ``start`` is [B] or a scalar -> [B, L] long. Padding
    positions get their row's next real position (clamped at ``start``); they are never attended to.
    """
    count = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    return count + (start[:, None] if isinstance(start, torch.Tensor) and start.dim() else start)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids [B, P] and attention_mask [B, P] (0 on padding) of token-id lists."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (CUDA launches are asynchronous), so wall times are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_int(name: str, value, minimum: int) -> None:
    """TypeError unless ``value`` is an int (bool is not), ValueError unless >= ``minimum``; both name ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
