"""fef's ``compile`` option: the draft head's steps through torch.compile give the eager steps' drafts (the same
logits up to float rounding, so greedy decoding is token for token the same), and the option is checked by name."""

import shutil

import pytest
import torch

import dllm
from dllm.models.draft_head import DraftHead, DraftHeadConfig

from test_two_stream import MASK, VOCAB
from test_two_stream import model as two_stream  # noqa: F401  (the module's fixture)

# torch.compile on a CPU writes C++ and builds it; torch's own compiler stack warns about its jit internals
pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="torch.compile on a CPU needs a C compiler (cc or gcc), none on PATH"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _head(model):
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig(vocab_size=VOCAB, backbone_dim=model.config.dim, dim=16, n_heads=2,
                                     mask_token_id=MASK, condition_first=True))
    with torch.no_grad():
        torch.nn.init.normal_(head.out.weight, std=1.0)
    return head.eval()


def test_compiled_head_steps_equal_the_eager_ones():
    head = _head(type("M", (), {"config": type("C", (), {"dim": 32})})())
    features, base = torch.randn(2, 4, 32), torch.randn(2, 4, VOCAB)
    eager, compiled = head.start(features, base), head.start(features, base, compiled=True)
    previous, offset = torch.tensor([1, 2]), torch.tensor([1, 1])
    for _ in range(4):
        a, b = eager.next(previous, offset), compiled.next(previous, offset)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        previous = a.argmax(-1)


def test_greedy_fef_with_a_compiled_head_is_token_for_token_the_eager_one(two_stream):  # noqa: F811
    prompt = torch.tensor([[1, 3, 0], [3, 3, 1]])
    common = dict(sampler="fef", window=3, draft="head", draft_head=_head(two_stream), max_new_tokens=6,
                  temperature=0.0, eos_token_id=None)
    eager = dllm.generate(two_stream, prompt, **common)
    compiled = dllm.generate(two_stream, prompt, compile=True, **common)
    assert torch.equal(eager.sequences, compiled.sequences) and compiled.options["compile"] is True
    assert compiled.stats.drafted > 0


def test_compile_is_checked_by_name(two_stream):  # noqa: F811
    with pytest.raises(ValueError, match="compile=True .* draft='head'"):
        dllm.generate(two_stream, torch.tensor([[1, 3]]), sampler="fef", compile=True, max_new_tokens=2)
    with pytest.raises(TypeError, match="compile must be True or False"):
        dllm.generate(two_stream, torch.tensor([[1, 3]]), sampler="fef", draft="head", compile="yes", max_new_tokens=2)
    from dllm.samplers import SAMPLERS

    assert SAMPLERS["fef"].options["compile"].parse("compile", "true") is True
    with pytest.raises(ValueError, match="compile expects true or false"):
        SAMPLERS["fef"].options["compile"].parse("compile", "maybe")
