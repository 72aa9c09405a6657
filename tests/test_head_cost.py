"""eval/study/head_cost.py: the head's steps against the backbone's state call at a target's shape."""

import json

import pytest

from dllm.eval.study.head_cost import main


def test_head_cost_writes_both_calls_and_the_ratios(tmp_path):
    assert main(["--arch", "tiny-bidirectional", "--layers", "1,2", "--reps", "1", "--context", "16", "--block", "8",
                 "--window", "4", "--dtype", "float32", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "head_cost.json").read_text())
    full, head = report["backbone_full_depth_seconds"], report["head_seconds"]
    assert set(full) == {"no_cache", "block_cache"} and set(head) == {"T0", "T1"}
    assert all(v > 0 for v in (*full.values(), *head.values()))
    assert report["ratio"]["T1 / block_cache"] == pytest.approx(head["T1"] / full["block_cache"])
    assert report["backbone_seconds"]["no_cache"].keys() == {"1", "2"}
    assert "| block against cached context |" in (tmp_path / "head_cost.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--window", "0"], "--window must be >= 1, got 0"),
    (["--layers", "0,1"], "--layers must lie in 1..2"),
    (["--layers", "a"], "--layers must be comma-separated ints"),
    (["--arch", "nowhere"], "--arch: architecture 'nowhere'"),
    (["--context", "-1"], "--context must be >= 0"),
])
def test_bad_flags_are_named(tmp_path, capsys, argv, message):
    arch = [] if "--arch" in argv else ["--arch", "tiny-bidirectional"]
    assert main([*arch, *argv, "--output", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
