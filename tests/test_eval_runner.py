"""`dllm eval TASK`: end to end on a tiny checkpoint, resume after partial writes and kills, sharding."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.hf import builders

from dllm.defaults import auto_dtype
from dllm.eval import runner
from dllm.eval.report import parse_samples, summarize_folder

REPO = Path(__file__).resolve().parents[1]
# shared/data sits beside the main checkout, or two levels up from a worktree (wt/NAME).
DATA_DIR = next((d for d in (REPO.parent / "shared" / "data", REPO.parents[1] / "shared" / "data")
                 if (d / "gsm8k_test.jsonl").is_file()), REPO.parent / "shared" / "data")
needs_data = pytest.mark.skipif(not (DATA_DIR / "gsm8k_test.jsonl").is_file(), reason="shared/data not present")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A block-causal TransformerLM (block size 2) whose positions reach past GSM8K's prompts."""
    folder = builders.save_dllm(tmp_path_factory.mktemp("tiny") / "model", layout="block_causal")
    config = json.loads((folder / "config.json").read_text())
    config["max_seq_len"] = 640  # rotary tables are built from the config; the weights do not depend on it
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _args(model: Path, out: Path, task: str = "synthetic", *extra: str) -> list[str]:
    """A fast run: fef with the exact block cache, 4 new tokens, 6 problems in batches of 3."""
    return [task, "--model", str(model), "--output", str(out), "--limit", "6", "--batch-size", "3",
            "--max-new-tokens", "4", "--option", "block_length=2", "--option", "window=2", "--no-progress", *extra]


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def _outcome(folder: Path) -> list[tuple]:
    """What must not move between equivalent runs: the rows' ids, completions and scores, in file order."""
    return [(r["id"], r["sample"], r["completion"], r["correct"], r["new_tokens"]) for r in _rows(folder)]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> Path:
    """One finished synthetic run at temperature 1 (so resumed runs must replay the same noise)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert runner.main(_args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3")) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@needs_data
def test_gsm8k_end_to_end(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DLLM_DATA_DIR", str(DATA_DIR))
    out = tmp_path / "gsm8k"
    assert runner.main(_args(tiny_model, out, "gsm8k", "--num-fewshot", "0")) == 0
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"gsm8k/{i}" for i in range(6)]
    assert rows[0]["prompt"].startswith("Question: Janet") and rows[0]["reference"] == "18"
    for row in rows:
        assert {"completion", "answer", "correct", "strict", "new_tokens", "batch"} <= set(row)
        assert 1 <= row["new_tokens"] <= 4 and row["batch"]["rows"] == 3
    summary = json.loads((out / "summary.json").read_text())
    lm_eval_metrics = {"lm_eval_strict_match", "lm_eval_flexible_extract"}
    assert set(summary["metrics"]) == {"accuracy", "strict_accuracy"} | lm_eval_metrics
    assert summary["counts"] == {"samples": 6, "problems": 6, "correct": sum(r["correct"] for r in rows),
                                 "batches": 2, "planned_samples": 6}
    # Speed is the sum over batches, each counted once although its stats sit on each of its rows.
    batches = {r["batch"]["id"]: r["batch"]["stats"] for r in rows}
    assert summary["speed"]["nfe"] == sum(s["nfe"] for s in batches.values())
    assert summary["speed"]["new_tokens"] == sum(s["new_tokens"] for s in batches.values())
    assert summary["sampler_options"]["window"] == 2 and summary["sampler_options"]["cache"] == "auto"
    assert summary["config"]["task_options"] == {"num_fewshot": 0}
    env = summary["environment"]
    auto = str(auto_dtype("cpu")).removeprefix("torch.")  # --dtype auto: bf16 on a CPU with native bf16
    assert env["batch_size"] == 3 and env["device"] == "cpu" and env["dtype"] == auto
    assert {"torch", "transformers", "dllm"} <= set(env["versions"]) and "git_commit" in env
    assert "accuracy" in capsys.readouterr().out


def test_synthetic_samples_per_problem(tiny_model, tmp_path):
    out = tmp_path / "samples"
    args = _args(tiny_model, out, "synthetic", "--num-samples", "2", "--temperature", "1")
    args[args.index("--limit") + 1] = "2"
    assert runner.main(args) == 0
    rows = _rows(out)
    assert [(r["id"], r["sample"]) for r in rows] == [("synthetic/0", 0), ("synthetic/0", 1),
                                                     ("synthetic/1", 0), ("synthetic/1", 1)]
    assert json.loads((out / "summary.json").read_text())["counts"]["problems"] == 2


def test_causal_model_with_a_drafter_and_chat_prompts(tmp_path):
    model = builders.save_causal(tmp_path / "llama", "llama")
    out = tmp_path / "ar_spec"
    assert runner.main(["synthetic", "--model", str(model), "--sampler", "ar_spec", "--option", f"drafter={model}",
                        "--chat", "--limit", "2", "--max-new-tokens", "4", "--output", str(out), "--no-progress"]) == 0
    prompt = _rows(out)[0]["prompt"]
    assert prompt.startswith("<|start|>user Solve") and prompt.endswith("<|start|>assistant ")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sampler_options"]["drafter"] == str(model) and summary["speed"]["nfe_draft"] > 0
    assert summary["config"]["task_options"] == {"chat": True}


def test_resume_after_partial_writes(reference, tiny_model, tmp_path):
    """A cut line, a cut batch or missing lines are recomputed; nothing is duplicated; same results at T=1."""
    data = (reference / "samples.jsonl").read_bytes()
    lines = data.splitlines(keepends=True)
    cases = {
        "mid_line": data[: len(data) - 40],  # last line cut: its whole batch (3 rows) is redone
        "two_lines_gone": b"".join(lines[:-2]),  # an incomplete batch
        "batch_gone": b"".join(lines[:3]),
        "empty": b"",
    }
    for name, content in cases.items():
        out = _copy(reference, tmp_path / name)
        (out / "samples.jsonl").write_bytes(content)
        (out / "summary.json").unlink()
        assert runner.main(_args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3")) == 0
        assert _outcome(out) == _outcome(reference), name
        summary, expected = (json.loads((f / "summary.json").read_text()) for f in (out, reference))
        assert summary["metrics"] == expected["metrics"] and summary["counts"] == expected["counts"]
        assert summary["attempts"] == 2


def test_rerun_of_a_finished_folder_recomputes_the_summary(reference, tiny_model, tmp_path):
    out = _copy(reference, tmp_path / "done")
    rows = _rows(out)
    rows[0]["correct"] = True  # a hand edit: the summary must follow samples.jsonl, not a stale summary.json
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text("{}")
    assert runner.main(_args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["correct"] == sum(r["correct"] for r in rows)
    assert summary["metrics"]["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 6)
    assert len(_rows(out)) == 6


def test_changed_config_is_refused(reference, tiny_model, tmp_path, capsys):
    out = _copy(reference, tmp_path / "other")
    before = (out / "samples.jsonl").read_bytes()
    assert runner.main(_args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "4")) == 2
    message = capsys.readouterr().err
    assert "holds a different run" in message and "seed: 3 in the folder, 4 now" in message
    assert (out / "samples.jsonl").read_bytes() == before
    # Batch size and limit may change on resume; a typed default option is the same run.
    args = _args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3", "--option", "window=2")
    args[args.index("--batch-size") + 1] = "2"
    assert runner.main(args) == 0


def test_parse_samples_keeps_whole_batches_only():
    def row(i, batch, rows):
        return json.dumps({"id": i, "sample": 0, "batch": {"id": batch, "rows": rows}}).encode() + b"\n"

    whole = row(0, "a", 2) + row(1, "a", 2)
    assert parse_samples(whole) == ([json.loads(row(0, "a", 2)), json.loads(row(1, "a", 2))], len(whole))
    assert parse_samples(whole + row(2, "b", 2))[1] == len(whole)  # batch b lacks a row
    assert parse_samples(whole + row(2, "b", 1)[:-5])[1] == len(whole)  # a line cut mid-way
    assert parse_samples(whole + b"not json\n" + row(2, "b", 1))[1] == len(whole)


def test_option_values_and_errors(tmp_path, monkeypatch, capsys):
    assert [runner.parse_value(v) for v in ("4", "0.5", "true", "None", "confidence", "1e-3")] == \
        [4, 0.5, True, None, "confidence", 0.001]
    monkeypatch.setattr(runner, "PACKAGE_DIR", tmp_path)
    assert runner.main(["synthetic", "--sampler", "ar", "--output", str(tmp_path / "x")]) == 2
    message = capsys.readouterr().err
    assert "weights/ar" in message and "pass --model" in message
    assert runner.main(["synthetic", "--num-fewshot", "2", "--model", "m", "--output", str(tmp_path / "y")]) == 2
    assert "num_fewshot" in capsys.readouterr().err
    assert runner.main(["synthetic", "--model", str(tmp_path / "nowhere"), "--output", str(tmp_path / "z")]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_sampler_needs_the_right_model_kind(tiny_model, tmp_path, capsys):
    assert runner.main(["synthetic", "--model", str(tiny_model), "--sampler", "ar", "--output", str(tmp_path)]) == 2
    assert "needs a causal model" in capsys.readouterr().err


def test_report_subcommand(reference, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert runner.main(["report", str(reference), "--png", str(tmp_path / "chart.png")]) == 0
    assert "| synthetic | fef |" in capsys.readouterr().out
    assert (tmp_path / "chart.png").stat().st_size > 0


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dllm.eval.runner", *args]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(reference, tiny_model, tmp_path):
    """A real kill at an arbitrary moment: the rerun ends with the uninterrupted run's rows, once each."""
    out = tmp_path / "killed"
    args = _args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3")
    args[args.index("--batch-size") + 1] = "1"  # six batches: the kill lands after the first
    process = subprocess.Popen(_command(*args), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if (out / "samples.jsonl").is_file() and (out / "samples.jsonl").stat().st_size > 0:
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "summary.json").exists(), "the run finished before the kill"
    assert runner.main(args) == 0
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == [f"synthetic/{i}" for i in range(6)]
    full = tmp_path / "uninterrupted"
    assert runner.main([*args[:args.index("--output") + 1], str(full), *args[args.index("--output") + 2:]]) == 0
    assert sorted(_outcome(out)) == sorted(_outcome(full))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_two_ranks_equal_one(reference, tiny_model, tmp_path):
    """torchrun with 2 CPU ranks: shards merged by rank 0 give the 1-process rows (even at T=1)."""
    out = tmp_path / "two"
    args = _args(tiny_model, out, "synthetic", "--temperature", "1", "--seed", "3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "dllm.eval.runner",
                             *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(out.glob("shard-*.jsonl"))
    assert sorted(_outcome(out)) == sorted(_outcome(reference))
    summary, expected = summarize_folder(out), summarize_folder(reference)
    assert summary["metrics"] == expected["metrics"] and summary["counts"] == expected["counts"]
    assert summary["environment"]["world_size"] == 2
