"""dllm's lm-eval backend against lm-eval's own `hf` backend (HFLM), side by side on a tiny local Llama.

Both get the same requests; dllm with sampler=ar must give identical generated text, log-likelihoods
within 1e-4, equal is_greedy and rolling (perplexity) scores within 1e-4, for a tokenizer that adds BOS
(as Llama, Mistral and Gemma tokenizers do) and one that adds none, with and without a chat template
(whose text starts with BOS), and with requests longer than the context.
"""

from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from fixtures.hf import builders  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval_tasks import jsonl_dataset, write_task  # noqa: E402
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
# lm-eval's hf backend keeps the checkpoint's float32 (its dtype "auto" reads the config), while dllm's "auto" is
# bfloat16 on a CPU with native bf16 (README, "Defaults"): the side-by-side runs fix float32 for dllm too.
SAME_DTYPE = "float32"


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
                  dtype=SAME_DTYPE, **kw)
    return hf, ours


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, tuple(a), i) for i, a in enumerate(args)]


def _chat(lm, text: str) -> str:
    return lm.apply_chat_template([{"role": "user", "content": text}])


def _greedy_pair(lm, prefix: str) -> tuple[str, str]:
    """prefix + two words whose argmax next token is a word (the random model often prefers ids past the
    tokenizer's), and that word."""
    words = {lm.tokenizer.convert_tokens_to_ids(w): w for w in builders.WORDS}
    for first in builders.WORDS:
        for second in builders.WORDS:
            context = f"{prefix}{first} {second}"
            with torch.inference_mode():
                best = int(lm.model(torch.tensor([lm.tok_encode(context)]))[0, -1].argmax())
            if best in words:
                return context, " " + words[best]
    raise AssertionError("no context of two words has a word as its argmax")


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

    greedy = _greedy_pair(ours, wrap("the cat") if chat else "")  # is_greedy True for it
    pairs = [(wrap(c) if c else c, t) for c, t in LOGLIKELIHOOD] + [greedy]
    ll = _requests("loglikelihood", pairs)
    theirs = hf.loglikelihood(ll)
    _assert_same_loglikelihoods(theirs, ours.loglikelihood(ll))
    assert theirs[-1][1] and not all(g for _, g in theirs)  # both values of is_greedy are compared

    rolling = _requests("loglikelihood_rolling", [(wrap(t),) for t in ROLLING])
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-4)


def test_same_numbers_with_add_bos_token_and_default_length(llama):
    """add_bos_token=True forces BOS as HFLM's does; without max_length both read the config's (128)."""
    path, _ = llama
    hf = HFLM(pretrained=str(path), device="cpu", batch_size=2, add_bos_token=True)
    ours = DllmLM(pretrained=str(path), sampler="ar", batch_size=2, add_bos_token=True, dtype=SAME_DTYPE)
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


def _tasks(folder: Path) -> Path:
    """generate_until, multiple_choice and loglikelihood_rolling tasks over a local JSONL (lm-eval's json loader)."""
    rows = [{"question": "the cat sat on the", "choices": ["mat", "dog ran"], "label": 0, "answer": "mat"},
            {"question": LONG, "choices": ["red", "cat sat"], "label": 1, "answer": "cat"}]
    common = jsonl_dataset(folder, rows)
    write_task(folder, "gen", "parity_gen", common, "generate_until",
               'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["blue"]\n'
               "  max_gen_toks: 5\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    write_task(folder, "mc", "parity_mc", common, "multiple_choice",
               'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
               "metric_list:\n  - metric: acc\n")
    write_task(folder, "ppl", "parity_ppl", common, "loglikelihood_rolling",
               'doc_to_text: ""\ndoc_to_target: "{{question}}"\nmetric_list:\n  - metric: word_perplexity\n')
    return folder


def test_simple_evaluate_side_by_side_with_chat_template(tmp_path, monkeypatch):
    """lm-eval builds the requests itself (a chat template that writes BOS, a tokenizer that adds it, contexts
    longer than max_length): every response equals the hf backend's."""
    from lm_eval.tasks import TaskManager

    for name, value in [("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "cache"))]:
        monkeypatch.setenv(name, value)
    path = _bos_llama(tmp_path / "model", adds_bos=True)
    tasks = TaskManager(include_path=str(_tasks(tmp_path)), include_defaults=False)
    names = ["parity_gen", "parity_mc", "parity_ppl"]
    samples = {}
    for model, args in [("hf", "device=cpu"), ("dllm", f"sampler=ar,dtype={SAME_DTYPE}")]:
        results = lm_eval.simple_evaluate(model=model, model_args=f"pretrained={path},max_length={MAX_LENGTH},{args}",
                                          tasks=names, task_manager=tasks, log_samples=True, apply_chat_template=True,
                                          batch_size=2)
        samples[model] = {t: sorted(results["samples"][t], key=lambda s: s["doc_id"]) for t in names}
    for task in names:
        ours, theirs = samples["dllm"][task], samples["hf"][task]
        assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]
        if task != "parity_ppl":  # (lm-eval applies no chat template to perplexity documents)
            assert all(s["arguments"][0][0].startswith("<bos><|start|>user") for s in ours)
        for mine, hers in zip(ours, theirs):
            if task == "parity_gen":
                assert mine["resps"] == hers["resps"]
            elif task == "parity_mc":
                _assert_same_loglikelihoods([r[0] for r in hers["resps"]], [r[0] for r in mine["resps"]])
            else:
                assert mine["resps"][0][0] == pytest.approx(hers["resps"][0][0], abs=1e-4)
