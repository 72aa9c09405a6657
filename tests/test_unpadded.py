"""Models that cannot pad: generate's refusal names the real reason and class; eval and bench group by length."""

import json
from pathlib import Path

import pytest
import torch
from fixtures.hf import builders
from test_bench import model_flags, save_tiny_models

import dllm
from dllm.counting import CountingModel
from dllm.eval import runner
from dllm.eval.study import bench
from dllm.models.transformer import TransformerConfig, TransformerLM


class NoMaskAttribute:
    """A diffusion model that declares nothing about padding."""

    mask_token_id, vocab_size = 9, 10

    def __call__(self, input_ids):
        return torch.zeros(*input_ids.shape, 10)


def _tiny(**flags) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, max_seq_len=32,
                                            layout="bidirectional", mask_token_id=15))
    for name, value in flags.items():
        setattr(model, name, value)
    return model


RAGGED = torch.tensor([[3, 4, 5], [0, 6, 7]]), torch.tensor([[1, 1, 1], [0, 1, 1]])


def test_refusal_names_the_real_reason_and_the_model_not_its_wrapper():
    model = _tiny(accepts_attention_mask=False, padding_note="its remote code ignores attention_mask")
    for seen in (model, CountingModel(model, bench.CallLog().record)):
        with pytest.raises(ValueError) as error:
            dllm.generate(seen, RAGGED[0], sampler="sequential", max_new_tokens=2, attention_mask=RAGGED[1])
        text = str(error.value)
        assert "TransformerLM cannot honour left padding (its accepts_attention_mask is False: its remote code " \
               "ignores attention_mask)" in text, text
        assert "CountingModel" not in text and "no accepts_attention_mask attribute" not in text
    with pytest.raises(ValueError, match="NoMaskAttribute declares no accepts_attention_mask"):
        dllm.generate(NoMaskAttribute(), RAGGED[0], sampler="sequential", max_new_tokens=2, attention_mask=RAGGED[1])


def test_group_by_length_keeps_first_appearance_order():
    assert runner.group_by_length([0, 1, 2, 3, 4], [5, 3, 5, 4, 3]) == [[0, 2], [1, 4], [3]]
    assert runner.padding_problem(_tiny(), [[1], [1, 2]]) is None  # it pads
    assert runner.padding_problem(_tiny(accepts_attention_mask=False), [[1, 2], [3, 4]]) is None  # no padding
    assert "cannot honour" in runner.padding_problem(_tiny(accepts_attention_mask=False), [[1], [1, 2]])


# ------------------------------------------------------------------ dllm eval


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder = builders.save_dllm(tmp_path_factory.mktemp("tiny") / "model", layout="block_causal")
    config = json.loads((folder / "config.json").read_text())
    config["max_seq_len"] = 256  # room for the synthetic prompts; the weights do not depend on it
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _eval(model: Path, out: Path, *extra: str) -> list[str]:
    return ["synthetic", "--model", str(model), "--output", str(out), "--limit", "6", "--batch-size", "3",
            "--max-new-tokens", "4", "--option", "block_length=2", "--option", "window=2", "--no-progress", *extra]


def _cannot_pad(monkeypatch):
    load = runner._load

    def without_padding(name, config):
        model = load(name, config)
        model.accepts_attention_mask = False  # as remote code that ignores attention_mask declares itself
        return model

    monkeypatch.setattr(runner, "_load", without_padding)


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def _outcome(folder: Path) -> list[tuple]:
    return [(r["id"], r["completion"], r["correct"], r["new_tokens"]) for r in _rows(folder)]


def test_eval_groups_by_length_and_matches_padding_at_t0(tiny_model, tmp_path, monkeypatch, capsys):
    assert runner.main(_eval(tiny_model, tmp_path / "padded")) == 0
    lengths = [len(runner._make_job(runner.EvalConfig("synthetic", limit=6), dllm.load(tiny_model),
                                    runner.get_task("synthetic"), {}).prompt_ids[i]) for i in range(6)]
    assert len(set(lengths[:3])) > 1 and len(set(lengths[3:])) > 1, lengths  # both batches are ragged
    capsys.readouterr()
    _cannot_pad(monkeypatch)
    assert runner.main(_eval(tiny_model, tmp_path / "grouped")) == 0
    err = capsys.readouterr().err
    assert err.count("cannot honour left padding") == 1 and "groups of equal prompt length" in err, err
    assert _outcome(tmp_path / "grouped") == _outcome(tmp_path / "padded")
    grouped, padded = _rows(tmp_path / "grouped"), _rows(tmp_path / "padded")
    assert [r["batch"]["rows"] for r in grouped] == [3] * 6  # the batches are the same, decoded in groups
    assert [r["batch"]["seed"] for r in grouped] == [r["batch"]["seed"] for r in padded]
    summary = json.loads((tmp_path / "grouped" / "summary.json").read_text())
    assert summary["speed"]["new_tokens"] == sum(r["new_tokens"] for r in grouped)


def test_eval_without_padding_resumes_to_the_same_samples_at_t1(tiny_model, tmp_path, monkeypatch):
    _cannot_pad(monkeypatch)
    sampled = ("--temperature", "1", "--seed", "5")
    assert runner.main(_eval(tiny_model, tmp_path / "whole", *sampled)) == 0
    partial = _eval(tiny_model, tmp_path / "resumed", *sampled)
    partial[partial.index("--limit") + 1] = "3"
    assert runner.main(partial) == 0
    assert runner.main(_eval(tiny_model, tmp_path / "resumed", *sampled)) == 0
    assert _outcome(tmp_path / "resumed") == _outcome(tmp_path / "whole")


# ------------------------------------------------------------------ dllm bench


def test_bench_batches_never_mix_lengths_without_padding():
    ids = [[1] * n for n in (3, 1, 3, 2, 3, 1)]
    batches = bench.make_batches(ids, 2, 0, "cpu", pad=False)
    assert [b.index for b in batches] == [[1, 5], [3], [0, 2], [4]]
    assert all(b.attention_mask is None for b in batches)
    assert [b.index for b in bench.make_batches(ids, 2, 0, "cpu")] == [[1, 5], [3, 0], [2, 4]]


def test_bench_runs_a_model_that_cannot_pad(tmp_path, monkeypatch, capsys):
    paths = save_tiny_models(tmp_path / "models")
    flags = model_flags(paths) + ["--num-prompts", "4", "--max-new-tokens", "4", "--batch-size", "4",
                                  "--repeats", "1", "--threads", "1",
                                  "--config", "name=fef;model=diffusion;sampler=fef;window=2"]
    assert bench.main(flags + ["--output", str(tmp_path / "padded")]) == 0
    load = dllm.load

    def without_padding(*args, **kwargs):
        model = load(*args, **kwargs)
        model.accepts_attention_mask = False
        return model

    monkeypatch.setattr(bench.dllm, "load", without_padding)
    capsys.readouterr()
    assert bench.main(flags + ["--output", str(tmp_path / "grouped")]) == 0
    out = capsys.readouterr().out
    assert out.count("TransformerLM cannot honour left padding") == 1, out
    padded, grouped = (json.loads((tmp_path / name / "results.json").read_text())["runs"][0]
                       for name in ("padded", "grouped"))
    assert grouped["examples"] == padded["examples"] and grouped["new_tokens"] == padded["new_tokens"]
    assert grouped["nfe"] > padded["nfe"]  # more, smaller calls: the prompts really had different lengths


def test_eval_on_remote_code_that_ignores_the_mask_equals_code_that_honours_it(tmp_path, capsys):
    """The LLaDA stand-ins (same weights; one ignores attention_mask, as old LLaDA snapshots did) at T=0."""
    ignores = builders.save_llada(tmp_path / "ignores", honours_attention_mask=False)
    honours = builders.save_llada(tmp_path / "honours", honours_attention_mask=True)
    if dllm.load(ignores, kind="remote").accepts_attention_mask:  # its own code (native LLaDA honours padding)
        pytest.skip("this folder's remote code now honours padding")
    args = ["synthetic", "--limit", "4", "--batch-size", "4", "--max-new-tokens", "4", "--sampler", "llada",
            "--no-progress", "--kind", "remote"]
    assert runner.main(args + ["--model", str(honours), "--output", str(tmp_path / "padded")]) == 0
    capsys.readouterr()
    assert runner.main(args + ["--model", str(ignores), "--output", str(tmp_path / "grouped")]) == 0
    assert "LLaDAAdapter cannot honour left padding" in capsys.readouterr().err
    assert _outcome(tmp_path / "grouped") == _outcome(tmp_path / "padded")
    grouped, padded = (_rows(tmp_path / name)[0]["batch"]["stats"]["nfe"] for name in ("grouped", "padded"))
    assert grouped > padded  # one call per group of equal length: the prompts were ragged
