"""The `dllm` model for lm-evaluation-harness: requests by hand, then a tiny local task end to end offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from fixtures.hf import builders  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

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


def test_diffusion_elbo_of_one_token_is_its_log_probability(diffusion_path):
    """With one continuation token every Monte-Carlo sample masks exactly it: the ELBO is exact."""
    lm = DllmLM(pretrained=str(diffusion_path), sampler="fef", mc_samples=3)
    context = lm.tok_encode("Tom has 3")
    token = lm.tok_encode(" apples")[0]
    (logprob, _), = lm._loglikelihood_tokens([(None, context, [token])])
    ids = torch.tensor([context + [lm.model.mask_token_id]])
    with torch.inference_mode():
        logits = lm.model(ids, block_offset=torch.tensor([len(context)]))
    assert logprob == pytest.approx(float(torch.log_softmax(logits[0, -1], dim=-1)[token]), abs=1e-4)
    (elbo, _), = lm._loglikelihood_tokens([(None, context, lm.tok_encode(" apples and"))])
    assert elbo < 0


def test_diffusion_rolling_loglikelihood_is_refused(diffusion_path):
    lm = DllmLM(pretrained=str(diffusion_path), sampler="fef")
    with pytest.raises(NotImplementedError, match="needs a causal model"):
        lm.loglikelihood_rolling([_request("loglikelihood_rolling", "Tom has 3 apples.")])


def _tiny_tasks(folder: Path) -> Path:
    """A generate_until and a multiple-choice task over a local JSONL file (lm-eval's `json` loader)."""
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              'doc_to_text: "{{question}}"\n')
    (folder / "gen.yaml").write_text(
        f"task: dllm_tiny_gen\n{common}output_type: generate_until\n" + 'doc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    (folder / "mc.yaml").write_text(
        f"task: dllm_tiny_mc\n{common}output_type: multiple_choice\n" + 'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    return folder


def test_simple_evaluate_offline(causal_path, diffusion_path, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tasks = TaskManager(include_path=str(_tiny_tasks(tmp_path)), include_defaults=False)  # skip indexing ~10k YAMLs
    for path, args in [(causal_path, "sampler=ar"), (diffusion_path, "sampler=fef,window=2,mc_samples=2")]:
        results = lm_eval.simple_evaluate(model="dllm", model_args=f"pretrained={path},{args}",
                                          tasks=["dllm_tiny_gen", "dllm_tiny_mc"], task_manager=tasks,
                                          log_samples=True)
        assert set(results["results"]) == {"dllm_tiny_gen", "dllm_tiny_mc"}
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
         f"pretrained={diffusion_path},sampler=llada,block_length=2", "--tasks", "dllm_tiny_gen",
         "--include_path", str(tasks), "--output_path", str(tmp_path / "out")],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dllm_tiny_gen" in result.stdout and "exact_match" in result.stdout
