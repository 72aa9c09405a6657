"""`dllm eval` at its edges: bad data and options end in one line, the context is checked before decoding
(--truncate left cuts as lm-eval does), Ctrl-C keeps what was written, and resuming says what it does.

Everything runs offline on a tiny checkpoint and data files written here (HF_*_OFFLINE set for subprocesses).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures.hf import builders

import dllm
from dllm.eval import data as data_module
from dllm.eval import get_task, runner
from dllm.eval.answers import truncate_at_stop
from dllm.eval.report import parse_samples

REPO = Path(__file__).resolve().parents[1]
# shared/data sits beside the main checkout, or two levels up from a worktree (wt/NAME).
DATA_DIR = next((d for d in (REPO.parent / "shared" / "data", REPO.parents[1] / "shared" / "data")
                 if (d / "gsm8k_test.jsonl").is_file()), None)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A block-causal TransformerLM (block size 2) with a 64-position context."""
    return builders.save_dllm(tmp_path_factory.mktemp("tiny") / "model", layout="block_causal")


def _qa_file(path: Path, questions: list[str], ids: bool = True) -> Path:
    rows = [{**({"id": f"q{i}"} if ids else {}), "question": q, "answer": f"#### {i}"} for i, q in enumerate(questions)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _args(model: Path, out: Path, *extra: str, task: str = "synthetic") -> list[str]:
    return [task, "--model", str(model), "--output", str(out), "--max-new-tokens", "4", "--option", "block_length=2",
            "--option", "window=2", "--batch-size", "3", "--no-progress", *extra]


def _error(capsys) -> str:
    """The run's stderr, which must be one line (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ bad data and options (issue 12, item 9)


def test_missing_field_names_file_line_and_field(tiny_model, tmp_path, capsys):
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n\n{"question": "What is 2 + 2?"}\n')
    assert runner.main(_args(tiny_model, tmp_path / "out", "--data-file", str(data))) == 2
    err = _error(capsys)
    assert f"{data}, line 3: missing field 'answer'" in err and "question, answer" in err
    data.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "What\n')
    assert runner.main(_args(tiny_model, tmp_path / "out", "--data-file", str(data))) == 2
    assert f"{data}, line 2: not valid JSON" in _error(capsys)
    assert not (tmp_path / "out").exists()  # refused before the output folder is made


def test_missing_field_with_alternatives_and_json_arrays(tmp_path):
    mbpp = tmp_path / "mbpp.json"
    mbpp.write_text(json.dumps([{"task_id": 11, "code": "x = 1", "test_list": []}]))
    with pytest.raises(data_module.DataError, match=r"record 1: missing field 'text' or 'prompt'"):
        get_task("mbpp", data_file=str(mbpp)).load()


def test_nonexistent_data_file_and_bad_subsets(tiny_model, tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    assert runner.main(_args(tiny_model, tmp_path / "out", "--data-file", str(missing))) == 2
    assert _error(capsys) == f"dllm eval: --data-file {missing} does not exist"
    assert runner.main(_args(tiny_model, tmp_path / "out", "--subset", "600", task="math")) == 2
    assert _error(capsys) == "dllm eval: --subset '600' is not a subset of math; choose one of ['500', 'full']"
    assert runner.main(_args(tiny_model, tmp_path / "out", "--subset", "full", task="gsm8k")) == 2
    assert "task gsm8k has no subsets" in _error(capsys)


def test_unreachable_hub_for_fewshot_examples_says_how_to_use_local_data(tiny_model, tmp_path, monkeypatch, capsys):
    def unreachable(sources):
        raise ConnectionError(f"Couldn't reach {sources[0].path}")

    monkeypatch.setattr(data_module, "_load_hub", unreachable)
    monkeypatch.delenv(data_module.DATA_DIR_ENV, raising=False)
    test_file = _qa_file(tmp_path / "test.jsonl", ["What is 1 + 1?"])
    assert runner.main(_args(tiny_model, tmp_path / "out", "--data-file", str(test_file), task="gsm8k")) == 2
    err = _error(capsys)
    assert "openai/gsm8k (main), split train" in err and "Couldn't reach openai/gsm8k" in err
    assert "train split" in err and "gsm8k_train.jsonl" in err and "--num-fewshot 0" in err


@pytest.mark.slow
def test_unreachable_hub_through_the_real_entry_point(tiny_model, tmp_path):
    """No data anywhere and the hub offline: one line naming --data-file, DLLM_DATA_DIR and the train split."""
    env = {k: v for k, v in os.environ.items() if k != data_module.DATA_DIR_ENV} | OFFLINE
    command = [sys.executable, "-m", "dllm.eval.runner", *_args(tiny_model, tmp_path / "o", task="gsm8k")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("dllm eval: cannot load openai/gsm8k (main), split test from the Hugging Face hub")
    assert "--data-file FILE" in err and "DLLM_DATA_DIR" in err and "gsm8k_test.jsonl" in err
    assert "gsm8k_train.jsonl" in err and "--num-fewshot 0" in err
    # An unreachable hub id for --model: transformers' OSError (two lines) as one line.
    command[command.index("--model") + 1] = "nobody/no-such-model"
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().startswith("dllm eval: cannot load nobody/no-such-model: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ------------------------------------------------------------------ the context (item 10)


def _fits_and_long(model: Path, tmp_path: Path, new: int) -> tuple[Path, list[int], int]:
    """A data file with two prompts that fit 64 - new positions and one (the second) that does not."""
    tokenizer = dllm.load(str(model)).tokenizer
    questions = ["What is 1 + 1?", "Tom has 3 apples. Anna has 5 pens. " * 2 + "How many?", "What is 2 + 5?"]
    data = _qa_file(tmp_path / "problems.jsonl", questions)
    lengths = [len(tokenizer(get_task("synthetic").prompt({"question": q}))["input_ids"]) for q in questions]
    assert lengths[0] + new <= 64 < lengths[1] + new and lengths[2] + new <= 64 and lengths[1] < 64, lengths
    return data, lengths, 64 - new


def test_eval_refuses_prompts_longer_than_the_context_before_decoding(tiny_model, tmp_path, capsys):
    data, lengths, room = _fits_and_long(tiny_model, tmp_path, new=16)
    out = tmp_path / "out"
    assert runner.main(_args(tiny_model, out, "--data-file", str(data), "--max-new-tokens", "16")) == 2
    err = _error(capsys)
    assert (f"problem q1: its prompt is {lengths[1]} tokens, and with --max-new-tokens 16 needs {lengths[1] + 16} "
            "> 64, the context of") in err
    assert "(1 of 3 prompts do not fit" in err and f"--max-new-tokens {64 - lengths[1]} fits every prompt" in err
    assert f"--truncate left, which keeps each prompt's last {room} tokens" in err
    assert "--num-fewshot" not in err  # synthetic prompts have no examples to drop
    assert not out.exists()


def test_eval_offers_fewer_shots_for_long_fewshot_prompts(tiny_model, tmp_path, monkeypatch, capsys):
    _qa_file(tmp_path / "gsm8k_train.jsonl", [f"What is {i} + {i}?" for i in range(8)], ids=False)
    _qa_file(tmp_path / "gsm8k_test.jsonl", ["What is 1 + 1?"], ids=False)
    monkeypatch.setenv(data_module.DATA_DIR_ENV, str(tmp_path))
    assert runner.main(_args(tiny_model, tmp_path / "out", task="gsm8k")) == 2
    err = _error(capsys)
    assert "problem gsm8k/0" in err and "fewer few-shot examples (--num-fewshot below 5)" in err
    assert "--truncate left" in err and "--max-new-tokens" in err


def test_eval_no_room_for_any_prompt(tiny_model, tmp_path, capsys):
    data = _qa_file(tmp_path / "p.jsonl", ["What is 1 + 1?"])
    assert runner.main(_args(tiny_model, tmp_path / "o", "--data-file", str(data), "--max-new-tokens", "64")) == 2
    assert "--max-new-tokens 64 leaves no room for a prompt" in _error(capsys)


@pytest.mark.skipif(DATA_DIR is None, reason="shared/data not present")
def test_shipped_model_gsm8k_fewshot_is_refused_up_front(tmp_path, monkeypatch, capsys):
    """The issue's case: 5-shot GSM8K prompts (~2000 tokens) on the shipped 256-position model."""
    monkeypatch.setenv(data_module.DATA_DIR_ENV, str(DATA_DIR))
    out = tmp_path / "gsm8k"
    assert runner.main(["gsm8k", "--limit", "2", "--max-new-tokens", "64", "--output", str(out), "--no-progress"]) == 2
    err = _error(capsys)
    assert "problem gsm8k/0: its prompt is" in err and "> 256, the context of" in err and "weights/diffusion" in err
    assert "--num-fewshot below 5" in err and "--truncate left" in err
    assert not out.exists()


def test_truncate_left_keeps_the_last_tokens_as_lm_eval_does(tiny_model, tmp_path, capsys):
    data, lengths, room = _fits_and_long(tiny_model, tmp_path, new=16)
    out = tmp_path / "out"
    args = _args(tiny_model, out, "--data-file", str(data), "--max-new-tokens", "16", "--truncate", "left")
    args[args.index("--batch-size") + 1] = "1"
    assert runner.main(args) == 0
    assert f"1 of 3 prompts cut to their last {room} tokens" in capsys.readouterr().err
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["truncate"] == "left" and run["attempts"][-1]["prompts_truncated"] == 1
    rows = {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    # Greedy decoding is deterministic: the long prompt's last `room` tokens, decoded directly, give its row.
    model, task = dllm.load(str(tiny_model)), get_task("synthetic")
    ids = model.tokenizer(rows["q1"]["prompt"])["input_ids"]
    assert len(ids) == lengths[1]
    out_ids = dllm.generate(model, torch.tensor([ids[-room:]]), sampler="fef", max_new_tokens=16, temperature=0.0,
                            block_length=2, window=2).sequences[0, room:].tolist()
    cut = out_ids[: out_ids.index(model.eos_token_id)] if model.eos_token_id in out_ids else out_ids
    assert rows["q1"]["completion"] == truncate_at_stop(model.tokenizer.decode(cut, skip_special_tokens=True),
                                                        task.stop)


def _default_args(model: Path, out: Path, *extra: str) -> list[str]:
    """_args without --max-new-tokens: the default applies."""
    args = _args(model, out, *extra)
    del args[args.index("--max-new-tokens"):args.index("--max-new-tokens") + 2]
    return args


def test_the_default_max_new_tokens_fits_the_context(tiny_model, tmp_path, capsys):
    """A first run with no --max-new-tokens decodes: the default 256 is capped at what the context (64) leaves
    after the longest prompt, in whole blocks, said in one line; an explicit value stays strict."""
    data, lengths, _ = _fits_and_long(tiny_model, tmp_path, new=16)
    longest = max(lengths)
    cap = (64 - longest) - (64 - longest) % 2  # block-causal, block size 2
    out = tmp_path / "out"
    assert runner.main(_default_args(tiny_model, out, "--data-file", str(data), "--batch-size", "3")) == 0
    err = capsys.readouterr().err
    assert (f"--max-new-tokens {cap} (the default 256 capped: the longest prompt, {longest} tokens, leaves {cap} of "
            f"{tiny_model}'s context of 64)") in err
    assert json.loads((out / "run.json").read_text())["identity"]["max_new_tokens"] == cap
    # Resuming with a --limit whose prompts are shorter keeps the folder's value instead of a larger cap.
    assert runner.main(_default_args(tiny_model, out, "--data-file", str(data), "--limit", "1")) == 0
    assert "holds a different run" not in capsys.readouterr().err
    assert runner.main(_args(tiny_model, tmp_path / "strict", "--data-file", str(data), "--max-new-tokens",
                             str(64 - longest + 1))) == 2
    assert "prompts do not fit" in _error(capsys)


def test_the_default_max_new_tokens_with_a_prompt_that_cannot_fit(tiny_model, tmp_path, capsys):
    """A prompt longer than the whole context: the default leaves half the context to prompts, and the refusal
    names the problem and the fixes (not "--max-new-tokens 256 leaves no room")."""
    data = _qa_file(tmp_path / "p.jsonl", ["What is 1 + 1?", "Tom has 3 apples. Anna has 5 pens. " * 6])
    assert runner.main(_default_args(tiny_model, tmp_path / "o", "--data-file", str(data))) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 32 (the default 256 capped: half of" in err
    assert "problem q1: its prompt is" in err and "with --max-new-tokens 32" in err and "--truncate left" in err


def test_the_default_max_new_tokens_of_the_shipped_models(tmp_path):
    """The shipped models (256 positions) with synthetic prompts: the cap solves generate's own rule exactly."""
    task = get_task("synthetic")
    for name, causal in (("diffusion", 0), ("ar", 1)):
        model = dllm.load(str(runner.PACKAGE_DIR / "weights" / name))
        ids = model.tokenizer([task.prompt(p) for p in task.load(20)])["input_ids"]
        config = runner.default_max_new(runner.EvalConfig("synthetic", output=str(tmp_path / name)), model, ids, name)
        new, block = config.max_new_tokens, getattr(model, "block_size", None) or 1
        assert 1 <= new < 256 and new % block == 0
        assert max(map(len, ids)) + new - causal <= 256 < max(map(len, ids)) + new + block - causal
        assert runner.default_max_new(config, model, ids, name) is config  # an explicit value is not changed


# ------------------------------------------------------------------ resuming (item 13)


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> Path:
    """30 questions short enough for the tiny model's context."""
    return _qa_file(tmp_path_factory.mktemp("data") / "short.jsonl", [f"What is {i} + 1?" for i in range(30)])


def _resumable(model: Path, data: Path, out: Path, temperature: float, *extra: str) -> list[str]:
    return _args(model, out, "--data-file", str(data), "--limit", "6", "--temperature", f"{temperature:g}", *extra)


@pytest.fixture(scope="module")
def finished(tiny_model, short_data, tmp_path_factory) -> dict[float, Path]:
    """Finished 6-problem runs (batches of 3) at temperature 0 and 1."""
    runs = {}
    for temperature in (0.0, 1.0):
        out = tmp_path_factory.mktemp("finished") / f"t{temperature:g}"
        assert runner.main(_resumable(model=tiny_model, data=short_data, out=out, temperature=temperature)) == 0
        runs[temperature] = out
    return runs


def _outcome(folder: Path) -> list[tuple]:
    rows = map(json.loads, (folder / "samples.jsonl").read_text().splitlines())
    return [(r["id"], r["sample"], r["completion"], r["correct"], r["new_tokens"]) for r in rows]


def _copy_first_rows(src: Path, dst: Path, rows: int | None) -> Path:
    dst.mkdir()
    (dst / "run.json").write_bytes((src / "run.json").read_bytes())
    if rows is not None:
        lines = (src / "samples.jsonl").read_bytes().splitlines(keepends=True)
        (dst / "samples.jsonl").write_bytes(b"".join(lines[:rows]))
    return dst


@pytest.mark.parametrize("rows", [None, 0, 2])  # no samples file, an empty one, a cut first batch
def test_a_run_that_saved_nothing_does_not_lock_its_folder(finished, tiny_model, short_data, tmp_path, capsys, rows):
    out = _copy_first_rows(finished[1.0], tmp_path / "crashed", rows)
    assert runner.main(_resumable(tiny_model, short_data, out, 1.0, "--seed", "5")) == 0
    assert "holds a run that saved no samples (seed: 0 in the folder, 5 now); replacing it" in capsys.readouterr().err
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["seed"] == 5 and len(run["attempts"]) == 1
    assert len((out / "samples.jsonl").read_text().splitlines()) == 6


def test_resume_reports_progress_and_limit_below_what_the_folder_holds(finished, tiny_model, short_data, tmp_path,
                                                                       capsys):
    out = _copy_first_rows(finished[1.0], tmp_path / "half", 3)
    args = _resumable(tiny_model, short_data, out, 1.0)
    assert runner.main(args) == 0
    err = capsys.readouterr().err
    assert "dllm eval: resuming: 3 of 6 done\n" in err and "warning" not in err and "already holds" not in err
    assert _outcome(out) == _outcome(finished[1.0])  # the same rows as the uninterrupted run, at T = 1
    args[args.index("--limit") + 1] = "2"
    assert runner.main(args) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 of 2 done (nothing left to decode)" in err
    assert "already holds 6 samples, more than the 2 this --limit 2 asks for; the summary covers all 6" in err
    assert json.loads((out / "summary.json").read_text())["counts"]["samples"] == 6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_warns_when_the_batch_size_changes_at_positive_temperature(finished, tiny_model, short_data, tmp_path,
                                                                          capsys, temperature):
    out = _copy_first_rows(finished[temperature], tmp_path / "resumed", 3)
    args = _resumable(tiny_model, short_data, out, temperature)
    args[args.index("--batch-size") + 1] = "2"
    assert runner.main(args) == 0
    err = capsys.readouterr().err
    assert "resuming: 3 of 6 done" in err
    warned = "warning: --batch-size 2 differs from [3] used before in this folder; at temperature 1" in err
    assert warned == (temperature > 0), err


# ------------------------------------------------------------------ Ctrl-C (item 9)


def test_ctrl_c_waits_until_a_batch_is_written_and_synced(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def fsync_after_ctrl_c(fd):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of writing a batch
        fsync(fd)
        synced.append(fd)

    monkeypatch.setattr(runner.os, "fsync", fsync_after_ctrl_c)
    rows = [{"id": i, "sample": 0, "batch": {"id": "b", "rows": 2}} for i in range(2)]
    with pytest.raises(KeyboardInterrupt):
        runner._append_rows(tmp_path / "samples.jsonl", rows)
    assert len(synced) == 1 and parse_samples((tmp_path / "samples.jsonl").read_bytes())[0] == rows


@pytest.mark.slow
def test_ctrl_c_keeps_the_written_batches_and_says_how_to_resume(tiny_model, short_data, tmp_path):
    out = tmp_path / "interrupted"
    args = _resumable(tiny_model, short_data, out, 1.0)
    args[args.index("--limit") + 1] = "30"
    args[args.index("--batch-size") + 1] = "1"
    process = subprocess.Popen([sys.executable, "-m", "dllm.eval.runner", *args], cwd=tmp_path,
                               env={**os.environ, **OFFLINE}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = out / "samples.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if samples.is_file() and samples.stat().st_size > 0:
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert not (out / "summary.json").exists(), "the run finished before Ctrl-C"
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    data = samples.read_bytes()
    rows, end = parse_samples(data)
    assert end == len(data) and 1 <= len(rows) < 30  # whole batches only: nothing to repair
    assert stderr.strip().splitlines()[-1] == (f"dllm eval: interrupted; {len(rows)} samples are saved in {out}; "
                                               "rerun with the same --output to resume")
    resumed = subprocess.run([sys.executable, "-m", "dllm.eval.runner", *args], cwd=tmp_path,
                             env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming: {len(rows)} of 30 done" in resumed.stderr
    after = samples.read_bytes()
    assert after.startswith(data) and len(parse_samples(after)[0]) == 30  # the saved batches stay as written
