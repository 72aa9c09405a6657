"""The `dllm` model for lm-evaluation-harness: requests by hand, then a tiny local task end to end offline."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from fixtures.hf import builders  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval_tasks import jsonl_dataset, write_task  # noqa: E402

import dllm  # noqa: E402
from dllm.eval.lm_eval_plugin import DllmLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROWS = [
    {"question": "the cat sat on the", "answer": "mat", "choices": ["mat", "dog"], "label": 0},
    {"question": "the dog ran to the", "answer": "cat", "choices": ["red", "cat"], "label": 1},
]


@pytest.fixture(scope="module")
def causal_path(tmp_path_factory) -> Path:
    return builders.save_causal(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="module")
def diffusion_path(tmp_path_factory) -> Path:
    return builders.save_dllm(tmp_path_factory.mktemp("dllm") / "model", layout="block_causal")


def _request(kind: str, *args) -> Instance:
    return Instance(kind, {}, tuple(args), 0)


def test_generate_until_respects_stop_strings_and_budget(causal_path):
    lm = DllmLM(pretrained=str(causal_path), sampler="ar_spec", num_draft_tokens=2)
    context = "the cat sat on the"
    ids = torch.tensor([lm.tok_encode(context)])
    greedy = dllm.generate(lm.model, ids, sampler="ar", max_new_tokens=6, temperature=0.0)
    text = lm._decode(greedy.sequences[0, ids.shape[1]:].tolist())
    words = text.split()
    assert len(words) >= 3, text  # the tiny random model rambles on; pick a stop word in the middle
    full, cut, short = lm.generate_until([
        _request("generate_until", context, {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
        _request("generate_until", context, {"until": [words[2]], "max_gen_toks": 6, "do_sample": False}),
        _request("generate_until", context, {"until": [], "max_gen_toks": 2}),
    ])
    assert full == text  # ar_spec at T=0 is greedy ar
    assert cut == text[: text.index(words[2])]
    assert len(lm.tok_encode(short)) <= 2 and text.startswith(short)


def test_causal_loglikelihood_is_exact(causal_path):
    lm = DllmLM(pretrained=str(causal_path), sampler="ar")
    (logprob, greedy), = lm.loglikelihood([_request("loglikelihood", "the cat sat", " on the mat")])
    context, continuation = lm.tok_encode("the cat sat"), lm.tok_encode("the cat sat on the mat")[3:]
    ids = torch.tensor([context + continuation])
    log_probs = torch.log_softmax(lm.model(ids).float(), dim=-1)[0]
    expected = sum(float(log_probs[len(context) - 1 + i, t]) for i, t in enumerate(continuation))
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert isinstance(greedy, bool)


def _block_model(folder: Path, block_size: int) -> Path:
    """save_dllm's block-causal model with another block size (the weights do not depend on it)."""
    builders.save_dllm(folder, layout="block_causal")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "block_size": block_size}))
    return folder


@pytest.fixture(scope="module")
def unit_block_path(tmp_path_factory) -> Path:
    return _block_model(tmp_path_factory.mktemp("unit") / "model", 1)


@pytest.fixture(scope="module")
def bidirectional_path(tmp_path_factory) -> Path:
    return builders.save_dllm(tmp_path_factory.mktemp("bidir") / "model", layout="bidirectional")


def _log_prob(model, ids: list[int], position: int, token: int, **kw) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), **kw)
    return float(torch.log_softmax(logits[0, position].float(), dim=-1)[token])


def test_diffusion_elbo_of_one_token_is_its_log_probability(diffusion_path):
    """With one continuation token every Monte-Carlo sample masks exactly it: the ELBO is exact. Its block
    (block_size 2) is filled with a mask past the continuation, as generation leaves it."""
    lm = DllmLM(pretrained=str(diffusion_path), sampler="fef", mc_samples=3)
    context, mask = lm.tok_encode("Tom has 3"), lm.model.mask_token_id
    token = lm.tok_encode(" apples")[0]
    (logprob, _), = lm._loglikelihood_tokens([(None, context, [token])])
    expected = _log_prob(lm.model, context + [mask, mask], len(context), token,
                         block_offset=torch.tensor([len(context)]))
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert lm.elbo_stderr[-1] == pytest.approx(0.0, abs=1e-6)


def test_block_causal_elbo_masks_block_by_block(unit_block_path):
    """block_size 1: block i is token i alone, scored after the clean tokens before it, so the ELBO is the
    exact left-to-right log-likelihood (one shared masking of the whole continuation would not be)."""
    lm = DllmLM(pretrained=str(unit_block_path), sampler="sequential", mc_samples=4)
    context, continuation = lm.tok_encode("Tom has"), lm.tok_encode(" 3 apples. Anna")
    assert len(continuation) >= 3
    mask, offset = lm.model.mask_token_id, torch.tensor([len(context)])
    expected = sum(_log_prob(lm.model, context + continuation[:i] + [mask], len(context) + i, t, block_offset=offset)
                   for i, t in enumerate(continuation))
    (elbo, greedy), = lm._loglikelihood_tokens([(None, context, continuation)])
    assert elbo == pytest.approx(expected, abs=1e-4)
    assert lm.elbo_stderr[-1] == pytest.approx(0.0, abs=1e-5)
    argmax = [_argmax(lm.model, context + continuation[:i] + [mask], offset) for i in range(len(continuation))]
    assert greedy == (argmax == continuation)


def _argmax(model, ids: list[int], offset) -> int:
    with torch.inference_mode():
        return int(model(torch.tensor([ids]), block_offset=offset)[0, -1].argmax())


@pytest.mark.parametrize("layout", ["block_causal", "bidirectional"])
def test_exact_loglikelihood_is_the_chain_the_samplers_sample(layout, diffusion_path, bidirectional_path, caplog):
    """loglikelihood=exact: each request's score is dllm.score's (brute force below: one conditional at a time on
    the canvas generate decodes), batched across requests of equal continuation length with ragged contexts, and
    is_greedy holds exactly for the continuation greedy sequential decoding produces."""
    path = diffusion_path if layout == "block_causal" else bidirectional_path
    lm = DllmLM(pretrained=str(path), sampler="fef", loglikelihood="exact", batch_size=4)
    assert lm.loglikelihood_method == "exact"
    model, mask = lm.model, lm.model.mask_token_id
    contexts = [lm.tok_encode(t) for t in ("Tom has 3", "Anna buys 2 pens and", "the cat sat on the")]
    greedy_answer = dllm.generate(model, torch.tensor([contexts[0]]), sampler="sequential", max_new_tokens=4,
                                  temperature=0.0, eos_token_id=None).sequences[0, len(contexts[0]):].tolist()
    requests = [(None, contexts[0], greedy_answer), (None, contexts[1], greedy_answer),
                (None, contexts[2], lm.tok_encode(" mat")), (None, contexts[1], greedy_answer[:3])]
    with caplog.at_level(logging.INFO, logger="lm_eval.models.dllm"):
        results = lm._loglikelihood_tokens(requests)
    assert "the exact chain (dllm.score)" in caplog.text
    size = model.block_size if layout == "block_causal" else None
    for (_, context, continuation), (value, greedy) in zip(requests, results):
        n = len(continuation)
        canvas = context + [mask] * (-(-n // size) * size if size else n)
        extra = {"block_offset": torch.tensor([len(context)])} if size else {}
        expected, argmax = 0.0, True
        for j, token in enumerate(continuation):
            expected += _log_prob(model, canvas, len(context) + j, token, **extra)
            with torch.inference_mode():
                logits = model(torch.tensor([canvas]), **extra)[0, len(context) + j].float()
                logits[mask] = -math.inf
            argmax &= int(logits.argmax()) == token
            canvas[len(context) + j] = token
        assert value == pytest.approx(expected, abs=1e-4) and greedy == argmax
    assert results[0][1] is True  # greedy decoding's own continuation
    assert lm.elbo_stderr == []  # no ELBO ran


def test_diffusion_elbo_is_unbiased_and_reports_its_standard_error(bidirectional_path, caplog):
    """The Monte-Carlo estimate lies within 4 of its reported standard errors of the exact ELBO, computed by
    enumerating every masked subset of a 3-token continuation (fixed seed)."""
    from itertools import combinations

    lm = DllmLM(pretrained=str(bidirectional_path), sampler="fef", mc_samples=400, mc_batch_size=100, seed=1,
                check_greedy=False)
    context, continuation = lm.tok_encode("Tom has"), lm.tok_encode(" 3 apples.")[:3]
    n, start, mask = len(continuation), len(context), lm.model.mask_token_id
    exact = 0.0
    for k in range(1, n + 1):  # l ~ U{1..n}, then a uniform subset of l positions, weighted n / l
        subsets = list(combinations(range(n), k))
        for subset in subsets:
            noisy = context + [mask if j in subset else t for j, t in enumerate(continuation)]
            with torch.inference_mode():
                log_probs = torch.log_softmax(lm.model(torch.tensor([noisy]))[0].float(), dim=-1)
            exact += sum(float(log_probs[start + j, continuation[j]]) for j in subset) / len(subsets) / k
    with caplog.at_level(logging.INFO, logger="lm_eval.models.dllm"):
        (estimate, greedy), = lm._loglikelihood_tokens([(None, context, continuation)])
    stderr = lm.elbo_stderr[-1]
    assert 0 < stderr < 1 and abs(estimate - exact) < 4 * stderr
    assert greedy is False  # check_greedy=False reports False without decoding
    assert "standard error" in caplog.text and "mc_samples=400" in caplog.text


def test_diffusion_rolling_loglikelihood_is_the_elbo_of_each_window(unit_block_path):
    """Exact for block_size 1 (see above): the text after the prefix token, token by token; a text longer
    than max_length is split into lm-eval's windows, each within the model's positions."""
    lm = DllmLM(pretrained=str(unit_block_path), sampler="sequential", mc_samples=2, check_greedy=False)
    text = "Tom has 3 apples."
    tokens, mask = lm.tok_encode(text), lm.model.mask_token_id
    context = [lm.prefix_token_id]
    offset = torch.tensor([1])
    expected = sum(_log_prob(lm.model, context + tokens[:i] + [mask], 1 + i, t, block_offset=offset)
                   for i, t in enumerate(tokens))
    long = " ".join(["Sam buys 2 more apples and has 5 apples."] * 12)
    assert len(lm.tok_encode(long)) > lm.max_length
    short, longer = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text),
                                              _request("loglikelihood_rolling", long)])
    assert short == pytest.approx(expected, abs=1e-4)
    assert math.isfinite(longer) and longer < short


def test_max_length_is_the_context_the_model_declares(causal_path):
    """max_length reads dllm.protocols.context_length, so a config that names its context only as LLaDA's
    max_sequence_length gives that length, not the tokenizer's or lm-eval's 2048; model_args still wins."""
    import types

    from dllm.protocols import context_length

    lm = DllmLM(pretrained=str(causal_path), sampler="ar")
    lm.model.config = types.SimpleNamespace(max_sequence_length=48)  # the adapter's view of a LLaDA config
    assert context_length(lm.model) == 48 and lm.max_length == 48
    assert DllmLM(pretrained=str(causal_path), sampler="ar", max_length=20).max_length == 20


def test_model_args_are_checked_before_loading(tmp_path):
    missing = str(tmp_path / "absent")  # loading it would fail: the key must be refused first
    with pytest.raises(ValueError, match="loglikelihood must be one of"):
        DllmLM(pretrained=missing, loglikelihood="mc")
    with pytest.raises(ValueError, match=r"unknown model_args key\(s\) \['widow'\].*'window'"):
        DllmLM(pretrained=missing, sampler="fef", widow=4)
    with pytest.raises(ValueError, match="mc_samples must be an int >= 1"):
        DllmLM(pretrained=missing, sampler="fef", mc_samples=0)
    with pytest.raises(ValueError, match="check_greedy must be True or False"):
        DllmLM(pretrained=missing, sampler="fef", check_greedy="yes")
    with pytest.raises(ValueError, match="sampler must be one of"):
        DllmLM(pretrained=missing, sampler="beam")


def test_sampler_option_values_are_checked_at_construction(diffusion_path, causal_path):
    with pytest.raises(ValueError, match="window must be >= 1"):
        DllmLM(pretrained=str(diffusion_path), sampler="fef", window=0)
    with pytest.raises(ValueError, match=r"sampler='fef' needs a diffusion model.*'ar', 'ar_spec'"):
        DllmLM(pretrained=str(causal_path), sampler="fef")
    lm = DllmLM(pretrained=str(causal_path), trust_remote_code=True)  # lm-eval users pass it
    assert lm.sampler == "ar"  # a causal model's default: lm-eval's own numbers
    lm = DllmLM(pretrained=str(diffusion_path), trust_remote_code=True)  # also to this project's checkpoints
    assert lm.sampler == "fef"
    with pytest.raises(ValueError, match=r"unknown model_args key\(s\) \['window'\]"):
        DllmLM(pretrained=str(causal_path), window=4)  # no sampler named: checked against ar's options


def test_batch_size_from_model_args_or_command_line(causal_path):
    """lm-eval passes --batch_size (default 1), max_batch_size and device to every model."""
    cli = {"batch_size": 1, "max_batch_size": None, "device": None}
    lm = DllmLM.create_from_arg_string(f"pretrained={causal_path},sampler=ar,batch_size=3", cli)
    assert lm.batch_size == 3
    lm = DllmLM.create_from_arg_string(f"pretrained={causal_path},sampler=ar", {**cli, "batch_size": "2"})
    assert lm.batch_size == 2  # the command line's value is a string
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        DllmLM.create_from_arg_string(f"pretrained={causal_path},sampler=ar,batch_size=big", cli)


def test_auto_batch_size_is_the_largest_that_fits(causal_path, monkeypatch):
    lm = DllmLM(pretrained=str(causal_path), sampler="ar", batch_size="auto", max_batch_size=5)
    requests = [_request("loglikelihood", "the cat", f" {w}") for w in ("sat", "ran on", "a big red")]
    one = DllmLM(pretrained=str(causal_path), sampler="ar").loglikelihood(requests)
    adapter = type(lm.model)
    plain = adapter.__call__

    def small_memory(self, input_ids, *args, **kw):  # as if more than 4 rows did not fit
        if input_ids.shape[0] > 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return plain(self, input_ids, *args, **kw)

    monkeypatch.setattr(adapter, "__call__", small_memory)
    assert 2 <= lm.batch_size <= 4  # accelerate shrinks 5 until it fits
    assert [r[0] for r in lm.loglikelihood(requests)] == pytest.approx([r[0] for r in one], abs=1e-5)


def test_chat_template_and_device_defaults(causal_path, caplog):
    with caplog.at_level(logging.INFO):
        lm = DllmLM(pretrained=str(causal_path), sampler="ar", device=None if torch.cuda.is_available() else "cuda:0")
    assert lm.chat_template(False) is None
    assert lm.chat_template(True) == builders.CHAT_TEMPLATE
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert lm._device.type == expected
    assert "cuda" not in caplog.text.lower()  # chosen quietly


def test_dtype_auto_is_the_checkpoints_as_in_lm_evals_hf_backend(causal_path, monkeypatch):
    """model_args dtype=auto (the default) keeps the checkpoint's dtype, as HFLM's: a float32 checkpoint stays
    float32 even where dllm's own ``auto`` picks bf16 (a CPU with native bf16, made so here); a name converts."""
    from lm_eval.models.huggingface import HFLM

    from dllm import defaults

    monkeypatch.setattr(defaults, "cpu_has_native_bf16", lambda: True)
    assert defaults.resolve_dtype("auto", "cpu") == torch.bfloat16  # dllm's own meaning, kept elsewhere
    dtype = lambda module: next(module.parameters()).dtype  # noqa: E731
    for given in ({"dtype": "auto"}, {"dtype": None}, {}):
        assert dtype(DllmLM(pretrained="diffusion", sampler="sequential", device="cpu", **given).model) == torch.float32
    converted = DllmLM(pretrained="diffusion", sampler="sequential", dtype="bfloat16", device="cpu")
    assert dtype(converted.model) == torch.bfloat16
    ours = DllmLM(pretrained=str(causal_path), sampler="ar", device="cpu")
    theirs = HFLM(pretrained=str(causal_path), device="cpu")  # lm-eval's default dtype: "auto"
    assert dtype(ours.model.model) == dtype(theirs.model) == torch.float32  # ours: the adapter's transformers model
    with pytest.raises(ValueError, match="model_args dtype must be one of"):
        DllmLM(pretrained="diffusion", sampler="sequential", dtype="float8", device="cpu")


def _tiny_tasks(folder: Path) -> Path:
    """A generate_until and a multiple-choice task over a local JSONL file (lm-eval's `json` loader)."""
    dataset = jsonl_dataset(folder, ROWS)
    common = dataset + 'doc_to_text: "{{question}}"\n'
    write_task(folder, "gen", "dllm_tiny_gen", common, "generate_until",
               'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n'
               "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    write_task(folder, "mc", "dllm_tiny_mc", common, "multiple_choice",
               'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    write_task(folder, "ppl", "dllm_tiny_ppl", dataset + 'doc_to_text: ""\n', "loglikelihood_rolling",
               'doc_to_target: "{{question}} {{answer}}"\nmetric_list:\n  - metric: word_perplexity\n')
    return folder


def test_simple_evaluate_offline(causal_path, diffusion_path, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tasks = TaskManager(include_path=str(_tiny_tasks(tmp_path)), include_defaults=False)  # skip indexing ~10k YAMLs
    for path, args in [(causal_path, "sampler=ar"), (diffusion_path, "sampler=fef,window=2,mc_samples=2")]:
        results = lm_eval.simple_evaluate(model="dllm", model_args=f"pretrained={path},{args}",
                                          tasks=["dllm_tiny_gen", "dllm_tiny_mc", "dllm_tiny_ppl"],
                                          task_manager=tasks, log_samples=True)
        assert set(results["results"]) == {"dllm_tiny_gen", "dllm_tiny_mc", "dllm_tiny_ppl"}
        assert math.isfinite(results["results"]["dllm_tiny_ppl"]["word_perplexity,none"])
        assert 0 <= results["results"]["dllm_tiny_mc"]["acc,none"] <= 1
        answers = [s["resps"][0][0] for s in results["samples"]["dllm_tiny_gen"]]
        assert len(answers) == 2 and all("\n" not in a for a in answers)


@pytest.mark.slow
def test_command_line_offline(diffusion_path, tmp_path):
    """`python -m dllm.eval.lm_eval_plugin run --model dllm ...`: lm-eval's CLI with the model registered."""
    tasks = _tiny_tasks(tmp_path)
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "dllm.eval.lm_eval_plugin", "run", "--model", "dllm", "--model_args",
         f"pretrained={diffusion_path},sampler=llada,block_length=2,mc_samples=2", "--tasks",
         "dllm_tiny_gen,dllm_tiny_ppl", "--batch_size", "2",  # a string on lm-eval's command line
         "--include_path", str(tasks), "--output_path", str(tmp_path / "out")],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dllm_tiny_gen" in result.stdout and "exact_match" in result.stdout
    assert "word_perplexity" in result.stdout and "standard error" in result.stderr


@pytest.mark.parametrize("model_args,message", [
    ("sampler=ar,foo=1", "unknown model_args key(s) ['foo']"),
    ("sampler=ar,mc_samples=0", "model_args mc_samples must be an int >= 1, got 0"),
])
def test_command_line_errors_are_one_line(causal_path, tmp_path, monkeypatch, capsys, model_args, message):
    """`dllm-lm-eval run` with a bad model_args key or value ends in one line naming it, not a traceback."""
    from dllm.eval import lm_eval_plugin

    for name, value in [("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "cache"))]:
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DLLM_DEBUG", raising=False)
    args = ["run", "--model", "dllm", "--model_args", f"pretrained={causal_path},{model_args}", "--tasks",
            "dllm_tiny_mc", "--include_path", str(_tiny_tasks(tmp_path))]
    assert lm_eval_plugin.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"dllm lm-eval: {message}")  # (lm-eval's own logging may precede it)
