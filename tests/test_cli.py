"""The dllm command line: generate on a checkpoint, on the demo, with steps and JSON output."""

import json

import pytest
from fixtures.hf import builders

from dllm.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"diffusion": builders.save_dllm(tmp_path_factory.mktemp("d"), layout="block_causal"),
            "causal": builders.save_dllm(tmp_path_factory.mktemp("c"), layout="causal")}


def test_generate_json_on_a_checkpoint(checkpoints, capsys):
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4",
                 "--option", "window=2", "--option", "block_length=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampler"] == "fef" and out["options"]["window"] == 2 and out["stats"]["nfe"] >= 1
    assert out["prompt"] == "Tom has 3" and out["exact"] is True


def test_generate_show_steps_marks_revealed_tokens(checkpoints, capsys):
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4",
                 "--option", "block_length=2", "--show-steps", "--temperature", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.strip().startswith("step")]
    assert steps and "[" in steps[0] and "_" in steps[0]  # fresh tokens bracketed, masks shown
    assert lines[-1].startswith("-- ")


@pytest.mark.parametrize("sampler", ["ar", "ar_spec"])
def test_generate_causal(checkpoints, capsys, sampler):
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["causal"]), "--sampler", sampler,
                 "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] <= 4


def test_demo_and_bad_sampler(capsys):
    assert main(["generate", "--demo", "--max-new-tokens", "8"]) == 0
    assert "HMM oracle demo" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--sampler must be one of"):
        main(["generate", "--sampler", "nope"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        main(["generate", "--demo", "--option", "window"])


def test_generate_trace_html(checkpoints, tmp_path, capsys):
    path = tmp_path / "trace.html"
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4",
                 "--option", "block_length=2", "--trace", str(path)]) == 0
    assert path.exists() and "<table" in path.read_text()


def test_ar_spec_default_drafts_with_the_shipped_diffusion_model(capsys):
    assert main(["generate", "Tom has 3 apples and buys 4 more.", "--sampler", "ar_spec", "--max-new-tokens", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["num_draft_tokens"] == 8 and out["exact"] is True
    assert out["stats"]["nfe_draft"] == out["stats"]["nfe"]  # one drafter call per round: the diffusion model


def test_bad_input_is_one_line_naming_the_parameter():
    with pytest.raises(SystemExit, match="dllm generate: window must be >= 1, got 0"):
        main(["generate", "--demo", "--option", "window=0", "--max-new-tokens", "4"])
