"""The one call path of the masked-diffusion samplers: sessions, and the exactness they declare."""

import pytest
import torch

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers.sessions import SESSIONS, Session, session_exact


def _model(layout):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=12, dim=16, n_layers=1, n_heads=2, max_seq_len=32, layout=layout,
                               block_size=4 if layout == "block_causal" else None, mask_token_id=2)
    return TransformerLM(config).eval()


@pytest.mark.parametrize("cache", ["none", "block", "prefix", "dual"])
@pytest.mark.parametrize("verifier", ["copies", "structured"])
def test_generate_reports_the_exactness_its_session_declares(cache, verifier):
    if verifier == "structured" and cache in ("prefix", "dual"):
        pytest.skip("the structured verifier refuses approximate caches")
    model = _model("bidirectional" if cache in ("prefix", "dual") else "block_causal")
    out = dllm.generate(model, torch.tensor([[1, 3, 4]]), sampler="fef", max_new_tokens=8, temperature=0,
                        block_length=4, cache=cache, verifier=verifier)
    assert out.exact == session_exact(model, cache=cache, block_length=4, verifier=verifier)
    assert out.exact == (SESSIONS[cache].exact and verifier == "copies")


def test_every_session_is_a_session():
    for cls in SESSIONS.values():
        assert isinstance(cls.exact, bool) and callable(cls.logits) and callable(cls.view)
    assert set(Session.__dict__) >= {"logits", "view", "begin_block"}


def test_counting_model_counts_through_one_record_and_forwards_only_what_the_model_has():
    from dllm.counting import Call, CountingModel, structured_tokens
    from dllm.stats import DecodeStats

    model = _model("block_causal")
    calls, stats = [], DecodeStats()
    seen = CountingModel(CountingModel(model, calls.append), stats.record)
    ids = torch.tensor([[1, 3, 4, 5], [1, 3, 4, 6], [1, 3, 4, 6]])
    assert torch.equal(seen(ids, served=2), model(ids))
    assert calls == [Call(3, 4)] and (stats.nfe, stats.row_calls, stats.forward_tokens) == (1, 2, 12)
    assert hasattr(seen, "forward_cached") == hasattr(model, "forward_cached")
    assert not hasattr(CountingModel(object(), calls.append), "forward_cached")
    assert structured_tokens(10, 4) == 19  # state, 4 drafts, 4 position queries, the bonus query


@pytest.mark.parametrize("cache", ["none", "block"])
def test_a_session_returns_the_features_of_the_call_it_makes(cache):
    """Draft heads read features through the session: the exact block cache gives the full call's."""
    from dllm.samplers.calling import Caller
    from dllm.samplers.canvas import Canvas
    from dllm.samplers.sessions import choose_session
    from dllm.stats import DecodeStats

    model = _model("block_causal")
    prompt = torch.tensor([[1, 3, 4, 5], [1, 6, 7, 8]])
    canvas = Canvas.start(prompt, 8, 4, model.mask_token_id)
    canvas.x[:, 4:6] = torch.tensor([[5, 6], [7, 8]])  # first block partly revealed
    mode = choose_session(cache, model, 4)
    session = SESSIONS[mode](canvas, Caller(model, DecodeStats(), None, torch.tensor([4, 4])))
    session.begin_block(0)
    view = session.view(torch.arange(2))
    logits, features = view.call(view.x, torch.arange(2), hidden=True)
    full_logits, full_features = model(canvas.x, block_offset=4, return_hidden=True)
    width = view.x.shape[1]
    torch.testing.assert_close(features, full_features[:, view.offset : view.offset + width], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, view.call(view.x, torch.arange(2)))


def test_every_masked_sampler_runs_the_one_loop_with_a_stepper_of_the_protocol():
    """The registry's run function is ``loop.run`` with the family's ``Stepping`` bound; every stepper it builds
    declares what the loop reads (``samplers.loop.Stepper``): lookahead, begin_block, logits, step."""
    import functools

    from dllm.samplers import SAMPLERS, loop
    from dllm.stats import DecodeStats

    model = _model("block_causal")
    for name, spec in SAMPLERS.items():
        if spec.model_kind != "diffusion":
            continue
        assert isinstance(spec.run, functools.partial) and spec.run.func is loop.run, name
        options = spec.configure({}, model=model, max_new_tokens=8).values()
        block = options.pop("block_length")
        options.pop("cache")
        stepper = spec.run.args[0].build(1.0, torch.Generator(), DecodeStats(), 8 // block, block, **options)
        assert isinstance(stepper.lookahead, bool), name
        assert all(callable(getattr(stepper, part)) for part in ("begin_block", "logits", "step")), name
