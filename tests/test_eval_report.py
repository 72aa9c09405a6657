"""`dllm eval report`: summaries rebuilt from samples.jsonl, the markdown table and the chart."""

import json
from pathlib import Path

import pytest

from dllm.eval import report
from dllm.stats import DecodeStats


def _stats(nfe: int, new_tokens: int, seconds: float, rounds: int) -> dict:
    return DecodeStats(nfe=nfe, row_calls=2 * nfe, new_tokens=new_tokens, rounds=rounds,
                       wall_time_s=seconds).to_dict()


def _write_run(folder: Path, task: str, sampler: str, options: dict, batches: list[tuple[dict, list[dict]]]) -> Path:
    """A results folder as the runner writes it: run.json plus rows carrying their batch's stats."""
    folder.mkdir(parents=True)
    identity = {"task": task, "task_options": {}, "model": "/models/tiny", "kind": "auto", "dtype": None,
                "sampler": sampler, "options": options, "sampler_options": {"window": 4, **options},
                "max_new_tokens": 16, "temperature": 0.0, "seed": 0, "num_samples": 1}
    planned = sum(len(rows) for _, rows in batches)
    run = {"identity": identity, "attempts": [{"batch_size": 2, "planned_samples": planned, "world_size": 1}]}
    (folder / "run.json").write_text(json.dumps(run))
    lines = []
    for index, (stats, rows) in enumerate(batches):
        batch = {"id": f"b{index}", "rows": len(rows), "seed": index, "exact": True, "stats": stats}
        lines += [json.dumps({"sample": 0, "completion": "", "new_tokens": 1, **row, "batch": batch}) for row in rows]
    (folder / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    gsm8k = _write_run(tmp_path / "gsm8k-fef", "gsm8k", "fef", {"window": 8}, [
        (_stats(4, 16, 2.0, 8), [{"id": "a", "correct": True, "strict": False},
                                 {"id": "b", "correct": False, "strict": False}]),
        (_stats(6, 8, 2.0, 4), [{"id": "c", "correct": True, "strict": True}]),
    ])
    code = _write_run(tmp_path / "humaneval-llada", "humaneval", "llada", {}, [
        (_stats(16, 32, 4.0, 32), [{"id": "h0", "correct": True, "passed": True},
                                   {"id": "h1", "correct": False, "passed": False}]),
    ])
    return [gsm8k, code]


def test_summary_counts_each_batch_once(runs):
    summary = report.summarize_folder(runs[0])
    assert summary["metrics"] == {"accuracy": pytest.approx(2 / 3), "strict_accuracy": pytest.approx(1 / 3)}
    assert summary["counts"] == {"samples": 3, "problems": 3, "correct": 2, "batches": 2, "planned_samples": 3}
    speed = summary["speed"]
    assert (speed["nfe"], speed["new_tokens"], speed["wall_time_s"]) == (10, 24, 4.0)
    assert speed["tokens_per_second"] == 6.0 and speed["tokens_per_call"] == 2.4
    assert speed["mean_acceptance_length"] == 2.0 and summary["complete"]


def test_code_task_reports_pass_at_1(runs):
    assert report.summarize_folder(runs[1])["metrics"] == {"accuracy": 0.5, "pass@1": 0.5}


def test_table_and_chart(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "out" / "chart.png"
    assert report.main([str(r) for r in runs] + ["--png", str(chart)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | task | sampler |") and set(lines[1]) <= set("| -")
    assert (f"| {runs[0]} | gsm8k | fef | window=8 | tiny | 0 | 16 | 3 | accuracy | 0.667 | 6.0 | 10 | 2.40 "
            "| 2.00 |") in lines
    assert (f"| {runs[1]} | humaneval | llada | defaults | tiny | 0 | 16 | 2 | pass@1 | 0.500 | 8.0 | 16 | 2.00 "
            "| 1.00 |") in lines
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000


def test_missing_folder_is_an_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no run.json" in capsys.readouterr().err


def test_report_of_a_missing_folder_is_one_prefixed_line(capsys, tmp_path):
    from dllm.eval.report import main as report_main

    assert report_main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"dllm eval: not evaluation folders (no run.json): {tmp_path / 'nope'}\n"


def test_chart_goes_beside_the_results_not_into_the_working_directory(runs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert report.main([str(runs[0])]) == 0  # one run: inside its folder
    assert (runs[0] / "eval_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.main([str(r) for r in runs]) == 0  # several: the folder that holds them
    assert (tmp_path / "eval_report.png").is_file()
    assert list(elsewhere.iterdir()) == []
    assert capsys.readouterr().out.rstrip().endswith(f"chart: {tmp_path / 'eval_report.png'}")


def test_report_without_matplotlib_prints_the_table_and_says_how_to_draw_the_chart(runs, monkeypatch, capsys):
    from dllm.cli import main
    from dllm.extras import install_command

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib now raises
    assert report.main([str(r) for r in runs]) == 0  # the table is the report; the chart is not drawn
    captured = capsys.readouterr()
    assert "gsm8k-fef | gsm8k | fef |" in captured.out
    assert captured.err == ("dllm eval report: no chart: the runs' plot needs matplotlib, which is not installed: "
                            f"{install_command('eval')}\n")
    # a chart asked for by name that cannot be drawn is a failure, said in one line with the same command
    assert main(["eval", "report", str(runs[0]), "--png", str(runs[0] / "x.png")]) == 1
    assert capsys.readouterr().err.endswith(f"needs matplotlib, which is not installed: {install_command('eval')}\n")
