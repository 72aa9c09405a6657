"""The one call path of the masked-diffusion samplers: sessions, and the exactness they declare."""

import pytest
import torch

import dllm
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers.canvas import SESSIONS, Session, session_exact


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
