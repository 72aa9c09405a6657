"""DecodeStats: the one set of decoding statistics every sampler reports, AR and diffusion alike;
StepEvent, what a ``generate`` callback receives after every step; and EntropyAcceptance, acceptance of
each verified draft against the target's entropy there (a callback: computed only when asked)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dllm.counting import Call


@dataclass
class DecodeStats:
    """Counters summed over all rounds and rows of one ``generate`` call.

    Definitions (the only place they are written down):

    - ``nfe``: calls of the target model. One batched call counts once, however many rows or
      verification copies it holds.
    - ``nfe_draft``: calls of a separate drafter model (``ar_spec``); 0 when drafts come from the
      target itself (``fef``) or from n-grams.
    - ``row_calls``: sequences served by target calls, summed over calls (a verification call with W
      copies of R rows counts R). ``new_tokens / row_calls`` is ``tokens_per_row_call``, the
      batch-size-independent "tokens per NFE" of one sequence; at batch size 1 it equals
      ``tokens_per_call``.
    - ``forward_tokens``: token positions the target processed over all calls, rows x length, padding
      and verification copies included. It is the honest cost of a call on hardware that does not
      parallelise for free (a CPU); ``forward_tokens_draft`` is the same for the drafter.
    - ``new_tokens``: generated tokens, prompt excluded (and, once EOS handling applies, tokens after
      a row's EOS excluded).
    - ``rounds``: row-rounds: every step or verification round counts once per row that took part.
    - ``drafted`` / ``accepted``: draft tokens proposed to, and accepted by, the verification core. A draft
      tree (``draft_candidates`` of ar_spec, or of fef on a two-stream model) counts its depths: a depth is
      drafted once however many candidates it had, and accepted when any of them was (ar_spec: an accepted
      alternative is the round's last draft; fef on a two-stream model: its branch's drafts after it count at
      their depths); ``siblings_taken`` counts the row-rounds that accepted an alternative.
    - ``mean_acceptance_length``: ``new_tokens / rounds``, i.e. tokens emitted per row per round,
      INCLUDING the correction or bonus token of a speculative round (vLLM's convention; gpt-fast
      counts accepted drafts only, which is ``accepted / rounds`` here). For non-speculative samplers
      it is the number of tokens committed per step, so both families read the same way.
    - ``draft_rounds``: the row-rounds that verified at least one draft; ``undrafted_tokens``: the tokens
      emitted by verification rounds that verified none (such as a sampler's first call after the prompt,
      which can emit one exact token only). ``tokens_per_draft_round`` is ``(new_tokens -
      undrafted_tokens) / draft_rounds``, EAGLE's tau (average acceptance length over drafting-verification
      cycles), comparable across answer lengths (``mean_acceptance_length`` counts the undrafted rounds).
    - ``acceptance_per_position[j]``: among rounds that proposed a draft at window index j, the
      fraction in which it was accepted. Acceptance stops at the first rejection, so this is the
      probability that drafts 0..j were all accepted, given that j was proposed.
    - ``tokens_per_call``: ``new_tokens / nfe``; ``acceptance_rate``: ``accepted / drafted``;
      ``tokens_per_second``: ``new_tokens / wall_time_s``.
    - acceptance against entropy (``EntropyAcceptance``, recorded only when passed as the callback): per
      draft the verification tested (up to and including a row's first rejection), the entropy in nats of
      the target's temperature-1 distribution at its position, and whether it was accepted.
    - ``steps``: steps of the decoding loop: each ``count_round`` or ``count_verification`` call once, however
      many rows took part (``rounds`` counts the rows). Synchronisations per step (bench's ``syncs_per_step``) are
      the device-to-host synchronising operations of the ``generate`` calls (``dllm.syncs``) divided by ``steps``.
    - ``wall_time_s``: wall-clock seconds of the whole decoding loop, after device synchronisation.

    Counting never waits for the device: ``count_round`` and ``count_verification`` add to tensors on the
    counts' device, and the counters that depend on values (``new_tokens``, ``drafted``, ``accepted``,
    ``draft_rounds``, ``undrafted_tokens``, ``siblings_taken`` and the per-position lists) take them in by one
    read, ``settle()``, which every read or write of one of them does first: they never read stale. ``nfe``,
    ``row_calls``, ``forward_tokens``, ``rounds`` and ``steps`` come from shapes and stay on the host.
    """

    # model calls and the token positions they fed (from shapes, on the host)
    nfe: int = 0
    nfe_draft: int = 0
    row_calls: int = 0
    forward_tokens: int = 0
    forward_tokens_draft: int = 0
    # what the loop made: tokens, row-rounds, steps
    new_tokens: int = 0
    rounds: int = 0
    steps: int = 0
    # what the verification saw (speculative samplers)
    drafted: int = 0
    accepted: int = 0
    draft_rounds: int = 0
    undrafted_tokens: int = 0
    siblings_taken: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0

    def record(self, call: Call) -> None:
        """Count one model call (``dllm.counting.Call``: every counter's one record of a call)."""
        tokens = call.rows * call.tokens
        if call.draft:
            self.nfe_draft += 1
            self.forward_tokens_draft += tokens
        else:
            self.nfe += 1
            self.row_calls += call.rows if call.served is None else call.served
            self.forward_tokens += tokens

    def count_round(self, emitted: torch.Tensor) -> None:
        """Record one step of a non-speculative sampler: ``emitted`` [N] tokens per taking-part row."""
        self.rounds += emitted.numel()
        self.steps += 1
        self._pend(emitted.long().sum()[None], emitted.device)

    def count_verification(
        self, num_drafts: torch.Tensor, num_accepted: torch.Tensor, num_emitted: torch.Tensor,
        branch: torch.Tensor | None = None, *, width: int | None = None,
    ) -> None:
        """Record one verification round; each argument is [N] over the rows that took part (``branch``: a
        draft tree's taken alternative per row, 0 for none). ``width``: the round's window (``drafts.shape[1]``),
        a bound on ``num_drafts`` known on the host; without it, one read of ``num_drafts.max()`` finds it."""
        self.rounds += num_emitted.numel()
        self.steps += 1
        num_drafts, num_accepted, num_emitted = num_drafts.long(), num_accepted.long(), num_emitted.long()
        drafting = num_drafts > 0
        taken = torch.zeros_like(num_drafts) if branch is None else (branch > 0).long()
        # new_tokens, drafted, accepted, draft_rounds, undrafted_tokens, siblings_taken (_SETTLED's order)
        rows = torch.stack([num_emitted, num_drafts, num_accepted, drafting.long(),
                            torch.where(drafting, 0, num_emitted), taken])  # [6, N]
        if width is None:
            width = int(num_drafts.max()) if num_drafts.numel() else 0
        if num_drafts.numel() and width:
            # Draft j counts where j < num_drafts, accepted where j < num_accepted, over the positions some row
            # of this round proposed (below the round's largest num_drafts), as the per-position loop did.
            j = torch.arange(width, device=num_drafts.device)
            reached = torch.stack([num_drafts, num_accepted.clamp(max=num_drafts.max())])  # [2, N]
            positions = (reached[:, :, None] > j).long().sum(1)  # [2, width]
        else:
            positions = None
        self._pend(rows.sum(1), num_emitted.device, positions)

    def _pend(self, totals: torch.Tensor, device: torch.device, positions: torch.Tensor | None = None) -> None:
        """Add ``totals`` [<= 6] (in _SETTLED's order) and ``positions`` [2, W] (drafted, accepted per position)
        to the pending device counters; out of place, so copies of these stats never share them."""
        state = self.__dict__
        if state.get("_totals") is not None and state["_totals"].device != device:
            self.settle()  # counts on another device: fold in what was there first
        pending = state.get("_totals")
        totals = _pad(totals, len(_SETTLED))
        state["_totals"] = totals if pending is None else pending + totals
        if positions is not None:
            pending = state.get("_positions")
            if pending is not None and pending.shape[1] != positions.shape[1]:
                wide = max(pending.shape[1], positions.shape[1])
                pending, positions = _pad(pending, wide), _pad(positions, wide)
            state["_positions"] = positions if pending is None else pending + positions

    def settle(self) -> DecodeStats:
        """Fold the counts pending on the device into the fields: one device-to-host read (none when nothing is
        pending). Reading or writing any counter calls it; call it to pay for the read at a chosen moment."""
        state = self.__dict__
        totals, positions = state.get("_totals"), state.get("_positions")
        if totals is None:
            return self
        state["_totals"] = state["_positions"] = None
        values = (totals if positions is None else torch.cat([totals, positions.flatten()])).tolist()
        for name, value in zip(_SETTLED, values):
            state[name] += value
        if positions is not None:
            per_position = values[len(_SETTLED) :]
            drafted, accepted = per_position[: positions.shape[1]], per_position[positions.shape[1] :]
            # The lists reach the furthest position any round proposed (drafted > 0), as they always did.
            width = max((j + 1 for j, d in enumerate(drafted) if d), default=0)
            self._grow(width)
            for j in range(width):
                state["drafted_per_position"][j] += drafted[j]
                state["accepted_per_position"][j] += accepted[j]
        return self

    def __getstate__(self) -> dict:
        """Copies and pickles carry settled counters only."""
        return dict(self.settle().__dict__)

    def _grow(self, width: int) -> None:
        missing = width - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)

    # Rates of two counters, each defined in the docstring above; 0 when the whole is 0 (nothing drafted, ...).
    mean_acceptance_length = property(lambda self: _ratio(self.new_tokens, self.rounds))
    acceptance_rate = property(lambda self: _ratio(self.accepted, self.drafted))
    tokens_per_call = property(lambda self: _ratio(self.new_tokens, self.nfe))
    tokens_per_draft_round = property(lambda self: _ratio(self.new_tokens - self.undrafted_tokens, self.draft_rounds))
    tokens_per_row_call = property(lambda self: _ratio(self.new_tokens, self.row_calls))
    tokens_per_second = property(lambda self: _ratio(self.new_tokens, self.wall_time_s))

    @property
    def acceptance_per_position(self) -> list[float]:
        return [_ratio(a, d) for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def __add__(self, other: DecodeStats) -> DecodeStats:
        """Sum two runs' counters (e.g. batches of one evaluation)."""
        total = DecodeStats()
        for name in ("nfe", "nfe_draft", "row_calls", "forward_tokens", "forward_tokens_draft", "new_tokens", "rounds",
                     "steps", "drafted", "accepted", "draft_rounds", "undrafted_tokens", "siblings_taken",
                     "wall_time_s"):
            setattr(total, name, getattr(self, name) + getattr(other, name))
        total._grow(max(len(self.drafted_per_position), len(other.drafted_per_position)))
        for src in (self, other):
            for j, (d, a) in enumerate(zip(src.drafted_per_position, src.accepted_per_position)):
                total.drafted_per_position[j] += d
                total.accepted_per_position[j] += a
        return total

    def to_dict(self) -> dict:
        """Counters and derived rates as plain JSON-ready values."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for name in ("mean_acceptance_length", "tokens_per_draft_round", "acceptance_rate", "acceptance_per_position",
                     "tokens_per_call", "tokens_per_row_call", "tokens_per_second"):
            out[name] = getattr(self, name)
        return out


class _Settled:
    """A DecodeStats counter whose value may have additions pending on the device: reading or writing it settles
    them first (``DecodeStats.settle``), so no reader ever sees a stale count."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, stats, owner=None):
        if stats is None:
            return self
        if stats.__dict__.get("_totals") is not None:
            stats.settle()
        return stats.__dict__[self.name]

    def __set__(self, stats, value) -> None:
        if stats.__dict__.get("_totals") is not None:
            stats.settle()  # then ``stats.new_tokens = n`` replaces a count that includes what was pending
        stats.__dict__[self.name] = value


# The counters counted on the device, in the order of DecodeStats._pend's totals; then the per-position lists.
_SETTLED = ("new_tokens", "drafted", "accepted", "draft_rounds", "undrafted_tokens", "siblings_taken")
for _name in (*_SETTLED, "drafted_per_position", "accepted_per_position"):
    setattr(DecodeStats, _name, _Settled(_name))


def _pad(counts: torch.Tensor, width: int) -> torch.Tensor:
    """``counts`` [..., W] padded with zeros to [..., width] (width >= W)."""
    return torch.nn.functional.pad(counts, (0, width - counts.shape[-1]))


@dataclass(frozen=True)
class StepEvent:
    """One step of one sampler, as its ``callback`` sees it: the rows that took part and what they became.

    Tensors are the sampler's own buffers (copy them to keep them: ``detached()``). Positions are canvas
    positions (prompt included), except a bool ``revealed``, which is a mask over view columns starting at
    canvas position ``offset``.
    """

    sampler: str
    rows: torch.Tensor  # [R] batch rows that took part
    x: torch.Tensor  # [R, L'] their tokens after the step (the canvas, or ar's sequence so far)
    offset: int = 0  # canvas position of column 0 of a bool ``revealed``
    revealed: torch.Tensor | None = None  # [R, Ls] bool over the view, or [R, K] positions (-1: none)
    window: torch.Tensor | None = None  # [R, W] positions of a speculative round's window (fef)
    drafts: torch.Tensor | None = None  # [R, W] draft tokens proposed this round (fef, ar_spec)
    num_drafts: torch.Tensor | None = None  # [R] drafts proposed per row
    num_accepted: torch.Tensor | None = None  # [R] drafts accepted per row
    # A draft tree's taken sibling (draft_candidates > 1), [R] each: ``branch`` 0 none, a > 0 the a-th sibling
    # of window index ``branch_depth`` (-1: none), which then stands where the chain's (rejected) draft
    # ``replaced`` was; ``drafts`` are then the path verification followed: the chain before it, the sibling,
    # and (fef on a two-stream model) its branch's drafts after it, whose targets are in ``target_logits``
    branch: torch.Tensor | None = None
    branch_depth: torch.Tensor | None = None
    replaced: torch.Tensor | None = None
    # [R, W(+1), V] the logits verification tested draft j against (row j; then the bonus row): the
    # target's own logits, before any temperature (fef, ar_spec)
    target_logits: torch.Tensor | None = None
    # the logits each revealed token was drawn from, before any temperature, aligned with ``revealed``: [R, K, V]
    # for positions (an exact sampler's chain conditional there; fef's and ar_spec's are ``target_logits`` along
    # the path verification followed), [R, Ls, V] over the view for a bool ``revealed`` (an approximate sampler's
    # marginals when it committed). What ``GenerateOutput.logprobs`` is made of (samplers/likelihood.py)
    emitted_logits: torch.Tensor | None = None
    # with generate(logprobs=True): what the rows emitted so far, with its log-probabilities ([R, N], 0.0 where
    # nothing was emitted yet) and top alternatives ([R, N, K]): GenerateOutput's fields as they grow (streams)
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None

    def detached(self, logits: bool = False) -> StepEvent:
        """A copy on the CPU that later steps cannot overwrite (samplers reuse their buffers).

        ``target_logits`` and ``emitted_logits`` ([R, W + 1, V]: megabytes per step at real vocabularies, for
        callers that keep every event) are dropped unless ``logits``."""
        heavy = ("target_logits", "emitted_logits")
        kept = {f.name: getattr(self, f.name).detach().cpu().clone() for f in fields(self)
                if torch.is_tensor(getattr(self, f.name)) and (logits or f.name not in heavy)}
        return replace(self, **kept, **({} if logits else dict.fromkeys(heavy)))

    def draft_outcomes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every draft verification tested -> (target entropy in nats [N], accepted [N] bool); see
        ``draft_outcomes``. Empty for a step that verified nothing."""
        if self.target_logits is None or self.num_drafts is None or self.num_accepted is None:
            return torch.empty(0), torch.empty(0, dtype=torch.bool)
        return draft_outcomes(self.target_logits, self.num_drafts, self.num_accepted)

    def __getitem__(self, name: str):
        """``event["x"]``: callbacks written against the earlier dict events keep working."""
        if name not in self.__dataclass_fields__ or getattr(self, name) is None:
            raise KeyError(name)
        return getattr(self, name)


def _ratio(part: float, whole: float) -> float:
    """part / whole, 0 when there is no whole (nothing drafted, no call, no time): every rate's one rule."""
    return part / whole if whole > 0 else 0.0


# --------------------------------------------------------------------------------------------------------
# Acceptance against entropy (Bebop's plot)
# --------------------------------------------------------------------------------------------------------


def target_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) at temperature 1, in float32 or wider -> [...] from [..., V].

    Temperature 1 whatever the run's temperature, so greedy and sampled runs are read on the same axis.
    A -inf logit (a forbidden token) has probability 0 and adds nothing (not 0 * -inf).
    """
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_probs = torch.log_softmax(scores, dim=-1)
    terms = torch.where(log_probs > -math.inf, log_probs.exp() * log_probs, torch.zeros_like(log_probs))
    return -terms.sum(dim=-1)


def draft_outcomes(
    target_logits: torch.Tensor,  # [R, W(+1), V] row j: what draft j is tested against
    num_drafts: torch.Tensor,  # [R]
    num_accepted: torch.Tensor,  # [R]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy [N], accepted [N]) of the drafts verification tested, row by row in window order.

    Draft j of a row is tested when j < num_drafts and drafts 0..j-1 were accepted, i.e. j <= num_accepted:
    acceptance stops at the first rejection, so later drafts never meet the target. Accepted: j < num_accepted.
    """
    width = min(target_logits.shape[1], int(num_drafts.max()) if num_drafts.numel() else 0)
    j = torch.arange(width, device=target_logits.device)
    tested = (j[None, :] < num_drafts[:, None]) & (j[None, :] <= num_accepted[:, None])  # [R, W]
    entropy = target_entropy(target_logits[:, :width][tested])  # only the tested rows' [N, V]
    return entropy.cpu(), (j[None, :] < num_accepted[:, None])[tested].cpu()


def linear_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, float | None]:
    """Least-squares line y = slope * x + intercept (float64); slope None when x does not vary."""
    if not x.numel():
        return None, None
    x, y = x.double(), y.double()
    spread = ((x - x.mean()) ** 2).sum()
    if float(spread) == 0.0:
        return None, float(y.mean())
    slope = ((x - x.mean()) * (y - y.mean())).sum() / spread
    return float(slope), float(y.mean() - slope * x.mean())


ENTROPY_BIN_NATS = 0.5  # bins of the table: fixed edges from 0, so every configuration shares them


@dataclass
class EntropyAcceptance:
    """Each tested draft's target entropy (nats, temperature 1) and whether it was accepted, over one or
    more ``generate`` calls; pass it as ``callback=`` (it reads ``StepEvent.draft_outcomes``)."""

    entropy: list[float] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)

    def __call__(self, event: StepEvent) -> None:
        entropy, accepted = event.draft_outcomes()
        self.entropy += entropy.tolist()
        self.accepted += accepted.tolist()

    def fit(self, bin_nats: float = ENTROPY_BIN_NATS) -> dict:
        """The linear fit of acceptance (0/1) on entropy and the acceptance-by-entropy-bin table."""
        if isinstance(bin_nats, bool) or not isinstance(bin_nats, int | float) or not 0 < bin_nats < math.inf:
            raise ValueError(f"bin_nats must be a number > 0 (the width of an entropy bin), got {bin_nats!r}")
        entropy, accepted = torch.tensor(self.entropy, dtype=torch.float64), torch.tensor(self.accepted).double()
        slope, intercept = linear_fit(entropy, accepted)
        index = torch.floor(entropy / bin_nats).long()
        bins = [{"low": k * bin_nats, "high": (k + 1) * bin_nats, "num_drafts": int((index == k).sum()),
                 "mean_entropy": float(entropy[index == k].mean()), "acceptance": float(accepted[index == k].mean())}
                for k in sorted(set(index.tolist()))]
        return {"entropy": "nats of the target's temperature-1 distribution at the draft's position",
                "num_drafts": len(self.entropy), "slope": slope, "intercept": intercept,
                "acceptance": float(accepted.mean()) if self.accepted else None, "bin_nats": bin_nats, "bins": bins}
