"""dllm's lm-eval backend against lm-eval's own `hf` backend (HFLM), side by side on a tiny local Llama.

Both get the same requests; dllm with sampler=ar must give identical generated text, log-likelihoods
within 1e-4, equal is_greedy and rolling (perplexity) scores within 1e-4, for a tokenizer that adds BOS
(as Llama, Mistral and Gemma tokenizers do) and one that adds none, with and without a chat template
(whose text starts with BOS), and with requests longer than the context.
"""

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from fixtures.hf import builders  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dllm.eval.lm_eval_plugin import DllmLM  # noqa: E402

MAX_LENGTH = 16  # short, so that some requests below do not fit
LONG = " ".join(builders.WORDS * 2)  # 34 words: longer than MAX_LENGTH
GEN = [("the cat sat on the", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
       ("a dog", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
       ("big red", {"until": ["cat", "dog"], "max_gen_toks": 5, "do_sample": False}),
       (LONG, {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
       ("one two", {"until": [], "max_gen_toks": 4})]
LOGLIKELIHOOD = [("the cat sat", " on the mat"), ("", "the dog ran"), ("the cat", " sat"), ("the cat", " ran"),
                 ("the cat", " sat on"), (LONG, " red blue"), ("a", " " + " ".join(builders.WORDS[:12]))]
ROLLING = ["the cat sat on the mat", LONG, "two"]


def _bos_llama(folder: Path, adds_bos: bool) -> Path:
    """The tiny Llama; with ``adds_bos`` its tokenizer prepends <bos> and its chat template starts with it."""
    builders.save_causal(folder, "llama")
    if adds_bos:
        from tokenizers.processors import TemplateProcessing

        tokenizer = AutoTokenizer.from_pretrained(folder)
        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
        tokenizer.chat_template = "{{ bos_token }}" + builders.CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["adds_bos", "no_bos"])
def llama(request, tmp_path_factory) -> tuple[Path, bool]:
    path = _bos_llama(tmp_path_factory.mktemp("llama") / "model", request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.encode("the cat")[0] == tokenizer.bos_token_id) == request.param  # the convention holds
    return path, request.param


def _pair(path: Path, batch_size: int, **kw) -> tuple[HFLM, DllmLM]:
    hf = HFLM(pretrained=str(path), device="cpu", batch_size=batch_size, max_length=MAX_LENGTH, **kw)
    ours = DllmLM(pretrained=str(path), sampler="ar", device="cpu", batch_size=batch_size, max_length=MAX_LENGTH,
                  **kw)
    return hf, ours


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, tuple(a), i) for i, a in enumerate(args)]


def _chat(lm, text: str) -> str:
    return lm.apply_chat_template([{"role": "user", "content": text}])


def _assert_same_loglikelihoods(theirs, ours) -> None:
    assert len(theirs) == len(ours)
    for (want, want_greedy), (got, got_greedy) in zip(theirs, ours):
        assert got == pytest.approx(want, abs=1e-4)
        assert got_greedy == want_greedy


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_same_numbers_as_lm_eval_hf(llama, chat, batch_size):
    path, adds_bos = llama
    hf, ours = _pair(path, batch_size)
    wrap = (lambda t: _chat(hf, t)) if chat else (lambda t: t)
    if chat:
        assert _chat(ours, "the cat") == _chat(hf, "the cat")
        assert _chat(hf, "the cat").startswith("<bos>") == adds_bos  # a chat template that writes BOS itself
    assert ours.prefix_token_id == hf.prefix_token_id
    for text in ["the cat sat", wrap("the cat sat"), ""]:
        assert ours.tok_encode(text) == hf.tok_encode(text)

    gen = _requests("generate_until", [(wrap(c), k) for c, k in GEN])
    texts = ours.generate_until(gen)
    assert texts == hf.generate_until(gen)
    assert any(texts)  # the tiny model says something, so equal text is not two empty strings

    pairs = [(wrap(c) if c else c, t) for c, t in LOGLIKELIHOOD]
    ll = _requests("loglikelihood", pairs)
    _assert_same_loglikelihoods(hf.loglikelihood(ll), ours.loglikelihood(ll))

    rolling = _requests("loglikelihood_rolling", [(wrap(t),) for t in ROLLING])
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-4)


def test_same_numbers_with_add_bos_token_and_default_length(llama):
    """add_bos_token=True forces BOS as HFLM's does; without max_length both read the config's (128)."""
    path, _ = llama
    hf = HFLM(pretrained=str(path), device="cpu", batch_size=2, add_bos_token=True)
    ours = DllmLM(pretrained=str(path), sampler="ar", batch_size=2, add_bos_token=True)
    assert ours.max_length == hf.max_length == 128
    ll = _requests("loglikelihood", LOGLIKELIHOOD)
    _assert_same_loglikelihoods(hf.loglikelihood(ll), ours.loglikelihood(ll))
    rolling = _requests("loglikelihood_rolling", [(t,) for t in ROLLING])
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-4)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_ar_spec_greedy_gives_ar_text(llama, batch_size):
    path, _ = llama
    requests = _requests("generate_until", GEN)
    ar = DllmLM(pretrained=str(path), sampler="ar", batch_size=batch_size, max_length=MAX_LENGTH)
    spec = DllmLM(pretrained=str(path), sampler="ar_spec", num_draft_tokens=3, batch_size=batch_size,
                  max_length=MAX_LENGTH)
    assert spec.generate_until(requests) == ar.generate_until(requests)
