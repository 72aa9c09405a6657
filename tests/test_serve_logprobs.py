"""``dllm serve``'s logprobs through the real openai client and lm-eval's own API backend, on the shipped models:
the numbers are offline ``generate``'s (completions and chat, streamed and not), ``echo`` scores the prompt as
``dllm.score`` does, and lm-eval's ``local-completions`` pointed at the server gives what ``dllm-lm-eval`` gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dllm
import dllm.stops

from serve_support import LiveServer, require_serve, serve_args

WEIGHTS = Path(dllm.__file__).resolve().parent / "weights"
QUESTION = "Tom has 3 bags with 4 apples each. How many apples does Tom have?"
PROMPT = f"Question: {QUESTION}\nAnswer:"


@pytest.fixture(scope="module", params=["diffusion", "ar"])
def server(request):
    require_serve()
    from dllm.serve.cli import build

    with LiveServer(build(serve_args("--model", request.param, "--dtype", "float32"))) as live:
        live.name = request.param
        live.model = dllm.load(request.param, dtype=torch.float32)
        live.sampler = "ar" if request.param == "ar" else "fef"  # the server's default for the model
        yield live


def _offline(model, prompt_ids: list[int], seed: int, top: int, **kwargs):
    out = dllm.generate(model, torch.tensor([prompt_ids]), max_new_tokens=24, temperature=1.0, logprobs=True,
                        top_logprobs=top, generator=torch.Generator().manual_seed(seed), **kwargs)
    n = int(out.stats.new_tokens)
    answer = out.sequences[0, len(prompt_ids):].tolist()[:n]
    stops = set(dllm.stops.resolve(model, "model") or ())
    kept = next((i for i, t in enumerate(answer) if t in stops), n)  # the server leaves the stop token out
    return answer[:kept], out.logprobs[0, :kept].tolist(), out.top_token_ids[0, :kept].tolist()


def test_completions_logprobs_are_generates_streamed_or_not(server):
    client, tokenizer = server.client(), server.model.tokenizer
    ids = tokenizer(PROMPT)["input_ids"]
    tokens, logprobs, top_ids = _offline(server.model, ids, seed=3, top=2, sampler=server.sampler)
    whole = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=24, temperature=1, seed=3,
                                      logprobs=2)
    got = whole.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(logprobs, abs=1e-6)
    assert got.tokens == [tokenizer.decode([t]) for t in tokens] and "".join(got.tokens) == whole.choices[0].text
    assert [list(top) for top in got.top_logprobs] == [[tokenizer.decode([t]) for t in row] for row in top_ids]
    assert got.text_offset == [len("".join(got.tokens[:i])) for i in range(len(got.tokens))]
    extension = whole.model_extra["dllm"]["logprobs"]
    assert extension["mode"] == "sampled" and extension["law"].startswith("the chain the exact sampler sampled")
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": [], "text": ""}
    for chunk in client.completions.create(model=server.name, prompt=PROMPT, max_tokens=24, temperature=1, seed=3,
                                           logprobs=2, stream=True):
        for choice in chunk.choices:
            streamed["text"] += choice.text
            if choice.logprobs is not None:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    streamed[key] += getattr(choice.logprobs, key)
    assert streamed["text"] == whole.choices[0].text
    assert streamed["tokens"] == got.tokens and streamed["token_logprobs"] == got.token_logprobs
    assert streamed["text_offset"] == got.text_offset


def test_chat_logprobs_are_generates_and_raw_mode_is_the_models_law(server):
    client, tokenizer = server.client(), server.model.tokenizer
    ids = tokenizer(PROMPT)["input_ids"]  # the chat template's text for one user turn (the training format)
    messages = [{"role": "user", "content": QUESTION}]
    tokens, logprobs, _ = _offline(server.model, ids, seed=5, top=3, sampler=server.sampler)
    whole = client.chat.completions.create(model=server.name, messages=messages, max_tokens=24, temperature=1,
                                           seed=5, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(logprobs, abs=1e-6)
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in tokens]
    assert all(len(entry.top_logprobs) == 3 and bytes(entry.bytes).decode() == entry.token for entry in content)
    streamed = []
    for chunk in client.chat.completions.create(model=server.name, messages=messages, max_tokens=24, temperature=1,
                                                seed=5, logprobs=True, top_logprobs=3, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    raw = client.chat.completions.create(model=server.name, messages=messages, max_tokens=24, temperature=0.5,
                                         seed=5, logprobs=True, extra_body={"logprobs_mode": "raw"})
    answer = tokenizer(raw.choices[0].message.content, add_special_tokens=False)["input_ids"]
    scored = dllm.score(server.model, torch.tensor([ids]), torch.tensor([answer]), temperature=1.0)
    assert [e.logprob for e in raw.choices[0].logprobs.content] == pytest.approx(scored.logprobs[0].tolist(), abs=1e-5)
    assert raw.model_extra["dllm"]["logprobs"]["mode"] == "raw"


def test_echo_scores_the_prompt_as_score_does(server):
    client, tokenizer = server.client(), server.model.tokenizer
    ids = tokenizer(PROMPT)["input_ids"]
    echoed = client.completions.create(model=server.name, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    choice = echoed.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[0] is None and echoed.usage.completion_tokens == 0
    scored = dllm.score(server.model, torch.tensor([ids[:1]]), torch.tensor([ids[1:]]), eos_token_id=None)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(scored.logprobs[0].tolist(), abs=1e-5)


@pytest.mark.parametrize("name", ["sdar", "ar"])
def test_lm_evals_local_completions_on_the_server_is_dllm_lm_eval(name, tmp_path, monkeypatch):
    """lm-eval's own API backend against dllm serve, beside the dllm backend with loglikelihood=exact, on a tiny
    task of each kind: the same generations, log-likelihoods within 1e-5, the same is_greedy. (The shipped block-
    causal ``diffusion`` model anchors its blocks at the answer, so a token's conditional depends on where the
    continuation starts, which echo cannot know: docs/guides/serve.md.)"""
    require_serve()
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
    from lm_eval.tasks import TaskManager
    from lm_eval_tasks import jsonl_dataset, write_task

    import dllm.eval.lm_eval_plugin  # noqa: F401  (registers the dllm model)
    from dllm.serve.cli import build

    for variable, value in [("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                            ("HF_DATASETS_CACHE", str(tmp_path / "cache"))]:
        monkeypatch.setenv(variable, value)
    rows = [{"question": PROMPT, "choices": [" Tom has 3*4=<<3*4=12>>12 apples.", " Tom has 7 apples."], "label": 0,
             "answer": "12"},
            {"question": "Question: Zoe has 19 cards and gives away 4. How many cards does Zoe have now?\nAnswer:",
             "choices": [" Zoe has 15 cards.", " Zoe now has 19-4=<<19-4=15>>15 cards."], "label": 1, "answer": "15"}]
    common = jsonl_dataset(tmp_path, rows)
    write_task(tmp_path, "gen", "serve_gen", common, "generate_until",
               'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n\\n"]\n'
               "  max_gen_toks: 32\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    write_task(tmp_path, "mc", "serve_mc", common, "multiple_choice",
               'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
               "metric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    path = WEIGHTS / name
    samples = {}
    with LiveServer(build(serve_args("--model", name, "--dtype", "float32"))) as live:
        for backend, args in [("local-completions", f"model={name},base_url={live.url}/v1/completions,"
                                                    f"tokenizer={path},tokenizer_backend=huggingface,"
                                                    "tokenized_requests=True,max_retries=1"),
                              ("dllm", f"pretrained={path},dtype=float32,loglikelihood=exact")]:
            results = lm_eval.simple_evaluate(model=backend, model_args=args, tasks=["serve_gen", "serve_mc"],
                                              task_manager=tasks, log_samples=True, batch_size=1)
            samples[backend] = {t: sorted(results["samples"][t], key=lambda s: s["doc_id"])
                                for t in ("serve_gen", "serve_mc")}
    served, ours = samples["local-completions"], samples["dllm"]
    assert [s["resps"] for s in served["serve_gen"]] == [s["resps"] for s in ours["serve_gen"]]
    for theirs, mine in zip(served["serve_mc"], ours["serve_mc"]):
        for (want, want_greedy), (got, got_greedy) in zip([r[0] for r in theirs["resps"]],
                                                          [r[0] for r in mine["resps"]]):
            assert got == pytest.approx(want, abs=1e-5) and got_greedy == want_greedy
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing was fetched: the tokenizer is the local folder's
