"""Trajectory rendering: rounds classified from sampler events, HTML and PNG written and readable."""

import re

import pytest
import torch

import dllm
from dllm.eval.study.trace import TraceRecorder, render_trace, trace_rounds
from dllm.stats import StepEvent

ALPHABET = "abcdefgh"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def oracle():
    return dllm.HMMOracle.random(num_states=4, num_tokens=len(ALPHABET), seed=0, stickiness=3.0, sharpness=2.0)


def _fef_trace(oracle, **options):
    trace = TraceRecorder()
    out = dllm.generate(oracle, torch.tensor([[0, 1, 2, 0]] * 8), sampler="fef", max_new_tokens=24, temperature=1.0,
                        generator=torch.Generator().manual_seed(3), callback=trace, window=4, **options)
    return trace.events, out


def _rows_with_a_rejection(events) -> list[int]:
    rows = set()
    for event in events:
        rejected = event["num_accepted"] < event["num_drafts"]
        rows |= set(event["rows"][rejected].tolist())
    return sorted(rows)


def test_hand_built_fef_round_is_classified():
    mask = 9
    event = StepEvent(**{"sampler": "fef", "rows": torch.tensor([0]), "offset": 2,
             "x": torch.tensor([[1, 1, 7, 6, mask, mask]]), "window": torch.tensor([[2, 3, 4, 5]]),
             "drafts": torch.tensor([[7, 8, 3, 4]]), "num_drafts": torch.tensor([4]),
             "num_accepted": torch.tensor([1]), "revealed": torch.tensor([[2, 3, -1, -1, -1]])})
    (round_,) = trace_rounds([event], mask_token_id=mask)
    cells = [(c.token, c.kind, c.note) for c in round_.cells]
    assert cells == [(7, "accepted", None), (6, "fixed", 8), (3, "rejected", None), (4, "rejected", None)]
    assert round_.summary == "4 drafted, 1 accepted, +1"


def test_a_taken_sibling_is_shown_in_place_of_the_rejected_draft():
    """A draft tree's round (branch > 0): the sibling notes the chain's draft it replaced (``replaced``); on a
    two-stream fef the drafts after it are its branch's, accepted or corrected like a chain's; ar_spec's leaf
    token after it is a bonus, not a correction of the draft there."""
    mask = 9
    tree = {"branch": torch.tensor([1]), "branch_depth": torch.tensor([1]), "replaced": torch.tensor([8])}
    common = {"sampler": "fef", "rows": torch.tensor([0]), "offset": 2, "window": torch.tensor([[2, 3, 4, 5]]),
              "num_drafts": torch.tensor([4]), **tree}
    event = StepEvent(**common, x=torch.tensor([[1, 1, 7, 5, 6, 2]]), drafts=torch.tensor([[7, 5, 6, 4]]),
                      num_accepted=torch.tensor([3]), revealed=torch.tensor([[2, 3, 4, 5, -1]]))
    (round_,) = trace_rounds([event], mask_token_id=mask)
    cells = [(c.token, c.kind, c.note) for c in round_.cells]
    assert cells == [(7, "accepted", None), (5, "accepted", 8), (6, "accepted", None), (2, "fixed", 4)]
    event = StepEvent(**common, x=torch.tensor([[1, 1, 7, 5, 6, mask]]), drafts=torch.tensor([[7, 5, 3, 4]]),
                      num_accepted=torch.tensor([2]), revealed=torch.tensor([[2, 3, 4, -1, -1]]))
    (round_,) = trace_rounds([event], mask_token_id=mask)
    cells = [(c.token, c.kind, c.note) for c in round_.cells]
    assert cells == [(7, "accepted", None), (5, "accepted", 8), (6, "fixed", 3), (4, "rejected", None)]
    ar = StepEvent("ar_spec", torch.tensor([0]), torch.tensor([[1, 1, 7, 5, 6]]), drafts=torch.tensor([[7, 5, 3, 4]]),
                   num_drafts=torch.tensor([4]), num_accepted=torch.tensor([2]), **tree)
    (round_,) = trace_rounds([ar], prompt_length=2)
    cells = [(c.token, c.kind, c.note) for c in round_.cells]
    assert cells == [(7, "accepted", None), (5, "accepted", 8), (6, "fixed", None), (3, "rejected", None),
                     (4, "rejected", None)]


def test_fef_trace_html_shows_every_round(oracle, tmp_path):
    events, out = _fef_trace(oracle)
    row = _rows_with_a_rejection(events)[0]
    page = render_trace(events, ALPHABET, tmp_path / "t.html", row=row, mask_token_id=oracle.mask_token_id)
    text = page.read_text()
    rounds = sum(row in e["rows"].tolist() for e in events)
    assert text.count("<tr><td class=meta>") == rounds
    assert 'class="accepted"' in text and 'class="fixed"' in text and "<s>" in text  # a replaced draft
    answer = "".join(ALPHABET[t] for t in out.sequences[row, 4:].tolist())
    assert re.search(r"<pre>(.*)</pre>", text).group(1) == answer
    assert "<b>prompt:</b> <code>abca</code>" in text


def test_fef_trace_png_is_written(oracle, tmp_path):
    events, _ = _fef_trace(oracle, order="confidence")
    path = render_trace(events, ALPHABET, tmp_path / "t.png", row=1, mask_token_id=oracle.mask_token_id)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_non_speculative_and_ar_traces(oracle, tmp_path):
    prompt = torch.tensor([[0, 1, 2, 0]])
    trace = TraceRecorder()
    dllm.generate(oracle, prompt, sampler="llada", max_new_tokens=8, steps=4, temperature=0, callback=trace)
    rounds = trace_rounds(trace.events, mask_token_id=oracle.mask_token_id)
    assert [sum(c.kind == "fixed" for c in r.cells) for r in rounds] == [2, 2, 2, 2]
    assert [sum(c.kind == "masked" for c in r.cells) for r in rounds] == [6, 4, 2, 0]
    trace = TraceRecorder()
    out = dllm.generate(oracle.as_causal(), prompt, sampler="ar_spec", drafter=oracle, max_new_tokens=10,
                        temperature=1.0, generator=torch.Generator().manual_seed(0), callback=trace)
    rounds = trace_rounds(trace.events, prompt_length=4)
    kept = [c.token for c in rounds[-1].cells if c.kind != "rejected"]
    assert kept == out.sequences[0, 4:].tolist()
    render_trace(trace.events, ALPHABET, tmp_path / "a.png", prompt_length=4)
    with pytest.raises(ValueError, match="prompt_length"):
        trace_rounds(trace.events)


def test_trace_with_a_real_tokenizer(tmp_path):
    from test_bench import save_tiny_models

    model = dllm.load(save_tiny_models(tmp_path)["diffusion"])
    ids = torch.tensor([model.tokenizer("Question: 3 + 4?\nAnswer:")["input_ids"]])
    trace = TraceRecorder()
    dllm.generate(model, ids, sampler="fef", max_new_tokens=8, temperature=0, block_length=4, callback=trace)
    page = render_trace(trace.events, model.tokenizer, tmp_path / "t.html").read_text()
    assert "Question:" in page and page.count("<tr><td class=meta>") == len(trace.events)
    assert render_trace(trace.events, model.tokenizer, tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match=".html or .png"):
        render_trace(trace.events, model.tokenizer, tmp_path / "t.txt")
