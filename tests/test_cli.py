"""The dllm command line: generate on a checkpoint, on the demo, with steps and JSON output."""

import json
import re
from pathlib import Path

import pytest
import torch
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
    assert "--sampler must be one of" in _one_line_exit(["generate", "--sampler", "nope"], capsys)
    assert "KEY=VALUE" in _one_line_exit(["generate", "--demo", "--option", "window"], capsys)


def test_generate_trace_html(checkpoints, tmp_path, capsys):
    path = tmp_path / "trace.html"
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4",
                 "--option", "block_length=2", "--trace", str(path)]) == 0
    assert path.exists() and "<table" in path.read_text()


def test_ar_spec_default_drafts_with_the_shipped_diffusion_model(capsys, monkeypatch):
    import dllm.cli as cli

    loaded = []
    real_load = cli._load

    def recording_load(path, flag, *rest):
        loaded.append((flag, path))
        return real_load(path, flag, *rest)

    monkeypatch.setattr(cli, "_load", recording_load)
    assert main(["generate", "Tom has 3 apples and buys 4 more.", "--sampler", "ar_spec", "--max-new-tokens", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["num_draft_tokens"] == 8 and out["exact"] is True
    assert out["stats"]["nfe_draft"] == out["stats"]["nfe"]  # one drafter call per round: the diffusion model
    # the shipped diffusion model distilled toward the AR target (its card: fewer rounds at the same cost), named by
    # the AR model's sampler_defaults.json: the command loads only the model, generate the drafter it names
    assert out["options"]["drafter"] == "ar_diffusion_drafter" and loaded == [("--model", str(cli.DEFAULTS["ar"]))]


def test_one_ar_spec_default_everywhere():
    """generate, dllm generate (above) and dllm bench draft with the same default: the AR model's declared one."""
    import torch

    import dllm
    from dllm.eval.study import bench
    from dllm.models.loading import load

    model = load("ar", dtype=torch.float32)
    prompt = torch.tensor([model.tokenizer.encode("Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:")])
    out = dllm.generate(model, prompt, sampler="ar_spec", max_new_tokens=8, temperature=0.0)
    assert out.options["drafter"] == "ar_diffusion_drafter" and out.options["num_draft_tokens"] == 8
    assert out.stats.nfe_draft == out.stats.nfe
    store = bench.ModelStore(dict(bench.DEFAULT_MODELS), torch.device("cpu"), torch.float32, None)
    run = bench.prepare(bench.parse_config("name=a;model=ar;sampler=ar_spec"), store, bench.Settings())
    assert run.config.drafter == "ar_diffusion_drafter" and run.options["drafter"] is store.get("ar_diffusion_drafter")
    explicit = bench.prepare(bench.parse_config("name=b;model=ar;sampler=ar_spec;drafter=ngram"), store,
                             bench.Settings())
    assert explicit.options["drafter"] == "ngram"  # a drafter the caller names wins


def test_bad_input_is_one_line_naming_the_parameter(capsys):
    assert _one_line_exit(["generate", "--demo", "--option", "window=0", "--max-new-tokens", "4"], capsys) == \
        "dllm generate: window must be >= 1, got 0"
    # fef's draft trees run left to right
    message = _one_line_exit(["generate", "--demo", "--option", "draft_candidates=2", "--option", "order=confidence",
                              "--max-new-tokens", "4"], capsys)
    assert message == "dllm generate: draft_candidates=2 runs with order='left_to_right' only, got order='confidence'"


# ---------------------------------------------------------------- options read by what the option expects


def test_option_text_is_parsed_by_the_option_type():
    from dllm.samplers import parse_options

    assert parse_options("fef", ["cache=none", "window=4", "order=confidence", "block_length=none"]) == \
        {"cache": "none", "window": 4, "order": "confidence", "block_length": None}
    assert parse_options("dream", ["top_k=none", "top_p=0.9", "alg=1e3"]) == {"top_k": None, "top_p": 0.9,
                                                                             "alg": "1e3"}
    assert parse_options("llada", ["remasking=true"]) == {"remasking": "true"}  # a string stays a string
    assert parse_options("ar_spec", ["drafter=ngram", "num_draft_tokens=8"]) == {"drafter": "ngram",
                                                                                  "num_draft_tokens": 8}
    assert parse_options("native", ['generate_kwargs={"steps": 4}']) == {"generate_kwargs": {"steps": 4}}
    with pytest.raises(ValueError, match="--option window expects an int, got '1e3'"):
        parse_options("fef", ["window=1e3"])
    with pytest.raises(ValueError, match="--option KEY=VALUE|expects KEY=VALUE"):
        parse_options("fef", ["window"])


def test_generate_option_cache_none_stays_a_string(checkpoints, capsys):
    assert main(["generate", "Tom has 3", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4",
                 "--option", "cache=none", "--option", "block_length=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["options"]["cache"] == "none"


def test_eval_option_cache_none_stays_a_string():
    from dllm.eval import runner

    config = runner.config_from_args(["synthetic", "--option", "cache=none", "--option", "window=2"])
    assert config.options == {"cache": "none", "window": 2}
    with pytest.raises(runner.EvalError, match="window expects an int"):
        runner.config_from_args(["synthetic", "--option", "window=two"])


def test_bench_config_and_toml_values_are_typed_by_the_option(tmp_path):
    from dllm.eval.study import bench

    assert bench.parse_config("name=a;model=d;sampler=dream;top_k=none;alg=entropy;temperature=1").options == \
        {"top_k": None, "alg": "entropy"}
    file = tmp_path / "study.toml"
    file.write_text('[[run]]\nname = "a"\nmodel = "d"\nsampler = "fef"\nwindow = "4"\ncache = "none"\n')
    assert bench.read_config_file(file)[2][0].options == {"window": 4, "cache": "none"}
    with pytest.raises(ValueError, match="configuration 'a': window expects an int"):
        bench.parse_config("name=a;model=d;sampler=fef;window=wide")


def test_lm_eval_model_args_are_typed_by_the_option(checkpoints):
    from dllm.eval.lm_eval_plugin import DllmLM

    lm = DllmLM.create_from_arg_string(f"pretrained={checkpoints['diffusion']},sampler=dream,top_k=none,"
                                       "alg=entropy,block_length=2,seed=3")
    assert lm.options == {"top_k": None, "alg": "entropy", "block_length": 2} and lm.seed == 3


# ---------------------------------------------------------------- every error ends in one line


def _one_line_exit(argv, capsys, status: int = 2) -> str:
    """The one line a usage error prints on stderr (exit status 2, nothing else printed)."""
    assert main(argv) == status
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err and len(captured.err.splitlines()) == 1, captured.err
    return captured.err.strip()


def test_unknown_option_and_wrong_model_kind_say_what_fits(capsys, monkeypatch):
    import dllm.cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the option was checked")

    monkeypatch.setattr(dllm.cli, "_load", no_loading)  # refused at the door, before seconds of loading
    message = _one_line_exit(["generate", "Tom", "--option", "windw=8"], capsys)
    assert message.startswith("dllm generate: --option names unknown option(s) ['windw'] for sampler 'fef'; "
                              "allowed: [") and "'window'" in message
    monkeypatch.undo()
    message = _one_line_exit(["generate", "Tom", "--sampler", "ar", "--model", "diffusion"], capsys)
    assert message.endswith("this TransformerLM is a diffusion model (samplers for it: dream, eb, fast_dllm, fef, "
                            "llada, llada2, native, sdar, sequential)")
    message = _one_line_exit(["generate", "Tom", "--sampler", "fef", "--model", "ar"], capsys)
    assert message.endswith("this TransformerLM is a causal model (samplers for it: ar, ar_spec, native)")


def test_version_and_help_show_defaults(capsys):
    from dllm import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"dllm {__version__}\n"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 64)" in text and "(default 0)" in text and "(default 0.0)" in text


def test_missing_model_and_drafter_are_one_line(capsys, tmp_path):
    assert _one_line_exit(["generate", "--model", str(tmp_path / "nowhere")], capsys) == \
        f"dllm generate: --model {tmp_path / 'nowhere'}: no such folder (a checkpoint folder or a hub id such as " \
        "org/model)"
    assert _one_line_exit(["generate", "--sampler", "ar_spec", "--drafter", str(tmp_path / "none"),
                           "--max-new-tokens", "4"], capsys).startswith(f"dllm generate: --drafter {tmp_path}")
    assert _one_line_exit(["generate", "--demo", "--option", "window=big"], capsys) == \
        "dllm generate: --option window expects an int, got 'big'"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_before_loading(capsys):
    for command in ("generate", "bench"):
        message = _one_line_exit([command, "--device", "cuda"], capsys)
        assert message.startswith(f"dllm {command}: --device cuda: CUDA is not available here")


def test_trace_png_without_matplotlib_fails_before_decoding(checkpoints, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib now raises
    # a missing library is not a usage error: status 1
    assert main(["generate", "Tom", "--model", str(checkpoints["diffusion"]), "--trace", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    from dllm.extras import install_command

    assert captured.err == ("dllm generate: the trace x.png (an .html trace does not) needs matplotlib, which is not "
                            f"installed: {install_command('bench')}\n")
    assert install_command("bench").endswith('[bench]"')
    assert captured.out == ""  # nothing loaded, nothing decoded


def test_bench_missing_model_is_one_line(capsys, tmp_path):
    message = _one_line_exit(["bench", "--model", f"diffusion={tmp_path / 'nope'}", "--config",
                              "name=a;model=diffusion;sampler=fef"], capsys)
    assert message == f"dllm bench: model 'diffusion': no folder at {tmp_path / 'nope'} (shipped models not " \
                      "there yet? pass --model ALIAS=PATH)"


def test_unreachable_hub_id_is_one_line_in_a_real_process():
    """The installed console script, offline: one line on stderr, no traceback."""
    import os
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = ["dllm", "generate", "--model", "nosuch-org/nosuch-model", "--max-new-tokens", "4"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr  # a usage error, as in dllm eval
    assert result.stderr.strip().splitlines()[-1] == (
        "dllm generate: --model nosuch-org/nosuch-model: no such folder, and the hub could not provide it "
        "(HF_HUB_OFFLINE is set and it is not in the local hub cache); pass a local checkpoint folder or a "
        "reachable hub id")


def test_unreachable_hub_online_is_one_line_without_retry_noise():
    """Online but no hub answering (a refused port stands in for no internet): the first refused connection
    ends it, in one line; no retry warnings (measured: 25.3 s before, 2.8 s after, most of it imports)."""
    import os
    import subprocess

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("DLLM_DEBUG", None)
    command = ["dllm", "generate", "--model", "someone/nonexistent-model", "hi", "--max-new-tokens", "4"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    assert result.stderr.startswith(
        "dllm generate: --model someone/nonexistent-model: no such folder, and the hub could not provide it (the "
        "hub (http://127.0.0.1:9) could not be reached: ") and len(result.stderr.splitlines()) == 1, result.stderr


def test_dllm_debug_keeps_the_exception(monkeypatch, tmp_path):
    from dllm.cli import UserError

    monkeypatch.setenv("DLLM_DEBUG", "1")  # the exception itself propagates, with its traceback
    with pytest.raises(UserError, match="no such folder"):
        main(["generate", "--model", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="window must be >= 1"):
        main(["generate", "--demo", "--option", "window=0"])


# ---------------------------------------------------------------- one default per setting


def test_every_entry_point_shares_the_defaults(checkpoints, capsys):
    import inspect

    import dllm
    from dllm import defaults
    from dllm.eval import runner
    from dllm.eval.lm_eval_plugin import DllmLM
    from dllm.eval.study import bench
    from dllm.samplers import SAMPLERS

    plugin = inspect.signature(DllmLM.__init__).parameters
    eval_args = runner.config_from_args(["synthetic"])  # (the parser leaves unset what a --preset may fill)
    temperatures = [inspect.signature(dllm.generate).parameters["temperature"].default, eval_args.temperature,
                    runner.EvalConfig("synthetic").temperature, bench.Settings().temperature,
                    plugin["temperature"].default]
    assert temperatures == [defaults.TEMPERATURE] * 5
    assert [eval_args.dtype, runner.EvalConfig("synthetic").dtype, bench.Settings().dtype, plugin["dtype"].default] \
        == [defaults.DTYPE] * 4
    fef = SAMPLERS["fef"].options
    assert (fef["window"].default, fef["draft"].default) == (defaults.FEF_WINDOW, defaults.FEF_DRAFT)
    assert main(["generate", "Tom", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    model = dllm.load(checkpoints["diffusion"])
    ids = torch.tensor([model.tokenizer("Tom")["input_ids"]])
    python = dllm.generate(model, ids, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert cli["options"] == python.options  # the same fef settings from the CLI and from Python
    greedy = dllm.generate(model, ids, max_new_tokens=4, temperature=0.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(python.sequences, greedy.sequences)  # the Python default is greedy, like the CLI's


def test_auto_dtype_is_bf16_only_with_native_bf16(monkeypatch):
    from dllm import defaults

    for amx, avx512_bf16, expected in [(False, False, torch.float32), (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert defaults.auto_dtype("cpu") == expected
        assert defaults.resolve_dtype("auto", None) == expected
    assert defaults.resolve_dtype("float16") == torch.float16 and defaults.resolve_dtype(None) is None
    with pytest.raises(ValueError, match="--dtype must be one of"):
        defaults.resolve_dtype("fp8", flag="--dtype")


def test_load_and_generate_cli_resolve_auto_with_the_same_function(checkpoints, monkeypatch, capsys):
    import dllm
    from dllm import defaults

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # as on a CPU with AMX
    model = dllm.load(checkpoints["diffusion"], dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16 == defaults.auto_dtype("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert next(dllm.load(checkpoints["diffusion"], dtype="auto").parameters()).dtype == torch.float32


def test_auto_dtype_on_this_machine():
    """What the CPU reports decides it: an AVX2-only CPU (no AMX, no AVX512-BF16) gets float32."""
    from dllm import defaults

    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert defaults.auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


# ---------------------------------------------------------------- the demo


def test_demo_honours_temperature_zero_and_the_token_budget(capsys):
    runs = []
    for seed in ("0", "1"):
        assert main(["generate", "--demo", "--temperature", "0", "--max-new-tokens", "40", "--seed", seed,
                     "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["text"] == runs[1]["text"]  # greedy: the seed does not matter
    assert runs[0]["stats"]["new_tokens"] == 40 and len(runs[0]["text"]) == 4 + 40  # not capped at 32
    sampled = [main(["generate", "--demo", "--temperature", "1", "--max-new-tokens", "40", "--seed", s, "--json"])
               or json.loads(capsys.readouterr().out)["text"] for s in ("0", "1")]
    assert sampled[0] != sampled[1]


def test_demo_header_says_why_it_runs(capsys):
    assert main(["generate", "--demo", "--max-new-tokens", "4"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("HMM oracle demo (--demo;") and "no model files" not in header


def test_ctrl_c_while_the_cli_starts_is_one_line():
    """Ctrl-C in the seconds `dllm eval` spends starting up ends in one line: the entry module imports
    nothing heavy before main's guard (measured: SIGINT 0.3-4 s after `dllm eval synthetic` starts gave an
    import traceback; at 9 s, the one-line message)."""
    import subprocess
    import sys

    for entry in ("dllm.cli", "dllm.eval.lm_eval_cli"):  # the two console scripts' modules
        code = f"import sys, {entry}; print([m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules])"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "[]", entry


def test_ctrl_c_during_the_heavy_imports_is_one_line_and_130(tmp_path):
    """SIGINT while the console script is importing torch (libtorch mapped, the import not done) ends in one
    line and exit status 130, not an import traceback (issue 12 item 9)."""
    import signal
    import subprocess
    import sys
    import time

    script = Path(sys.executable).with_name("dllm")
    if not script.is_file() or not Path("/proc/self/maps").is_file():
        pytest.skip("needs the installed console script and /proc")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("DLLM_DEBUG", None)
    process = subprocess.Popen([str(script), "eval", "synthetic", "--limit", "1", "--output", str(tmp_path / "o")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text() and process.poll() is None:
        assert time.monotonic() < deadline, "torch was never imported"
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and err.startswith("dllm eval: interrupted"), err


def test_import_dllm_is_lazy_and_its_public_names_resolve():
    """`import dllm` imports no torch; each public name then resolves to the object its module defines."""
    import subprocess
    import sys

    code = ("import sys, dllm; lazy = 'torch' not in sys.modules; import dllm.api, dllm.models.loading; "
            "print(lazy, dllm.generate is dllm.api.generate, dllm.load is dllm.models.loading.load, "
            "sorted(dllm.__all__) == sorted(n for n in dir(dllm) if n in dllm.__all__))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True"] * 4
    import dllm

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dllm.nope  # noqa: B018


USAGE_ERRORS = {  # command line -> the start of its one line on stderr
    ("generate", "--demo", "--option", "window=0"): "dllm generate: window must be >= 1, got 0",
    ("eval", "synthetic", "--temperature", "-1"): "dllm eval: --temperature must be >= 0",
    ("eval", "report", "/nope"): "dllm eval: not evaluation folders",
    ("bench", "--model", "nope"): "dllm bench: --model expects KEY=VALUE",
    ("bench", "--config", "name=a;model=diffusion;sampler=nope"): "dllm bench: configuration 'a': sampler must be",
    ("train", "--config", "x.toml", "--set", "steps"): "dllm train: --set expects TABLE.KEY=VALUE",
    ("train", "--eval", "/nope"): "dllm train: ",
}


@pytest.mark.parametrize("argv", list(USAGE_ERRORS), ids=" ".join)
def test_usage_errors_exit_2_in_one_line_from_every_command(argv):
    """A real `python -m dllm.cli` process: a bad flag value is exit status 2 and one line, whichever command."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("DLLM_DEBUG", None)
    done = subprocess.run([sys.executable, "-m", "dllm.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(USAGE_ERRORS[argv]), done.stderr


@pytest.mark.parametrize("model", ["two_stream", "dllm/weights/diffusion"])
def test_a_shipped_model_named_by_model_gets_the_training_format(model, capsys):
    """--model naming a shipped model (bare name or folder) formats the prompt as the model was trained,
    as the default model does: the answer is the synthetic format's, not noise."""
    folder = Path(__file__).resolve().parents[1] / "dllm" / "weights" / model.split("/")[-1]
    if not (folder / "model.safetensors").exists():
        pytest.skip("shipped weights not present")
    name = model if "/" not in model else str(folder)
    assert main(["generate", "Tom has 3 bags with 4 apples each. How many apples does Tom have?", "--model", name,
                 "--max-new-tokens", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"].startswith("Question: Tom has 3 bags") and "#### 12" in out["completion"]


# ---------------------------------------------------------------- what a new user meets (issue 30)


def test_no_prompt_says_which_question_it_decodes(checkpoints, capsys):
    from dllm.cli import _DEFAULT_PROMPT

    assert main(["generate", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == f"no prompt given: using the demo question {_DEFAULT_PROMPT!r}\n"
    assert main(["generate", "Tom", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_a_capped_window_is_said_in_one_line(checkpoints, capsys):
    argv = ["generate", "Tom", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4"]
    assert main([*argv, "--option", "window=6"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(r"dllm generate: warning: window=6 is longer than block_length=2: fef "
                                          r"drafts at most 2 tokens a round \(the window is capped at the block\)",
                                          err[0]), err  # the test checkpoint's blocks are 2 long
    assert main([*argv, "--option", "window=2"]) == 0
    assert capsys.readouterr().err == ""


def _generate_help(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_sampler_help_lists_every_sampler(capsys):
    from dllm.samplers import SAMPLERS

    text = " ".join(_generate_help(capsys).split())
    sampler_help = text.split("--sampler SAMPLER ", 1)[1].split(" --drafter ", 1)[0]
    named = {word.strip(",;()") for word in sampler_help.split()}
    assert set(SAMPLERS) <= named, set(SAMPLERS) - named


def test_every_field_of_the_stats_line_is_explained_in_the_help(checkpoints, capsys):
    """Each part of the stats line is defined, under the same words, in the epilog of `dllm generate --help`."""
    help_text = " ".join(_generate_help(capsys).split())
    assert main(["generate", "Tom", "--model", str(checkpoints["diffusion"]), "--max-new-tokens", "4"]) == 0
    stats = capsys.readouterr().out.splitlines()[-1]
    parts = ["new tokens in", "tok/s", "model calls", "draft)", "tokens/call", "mean acceptance length",
             "exact sampler"]
    assert stats.startswith("-- ") and all(part in stats for part in parts), stats
    epilog = help_text.split("the line after the answer", 1)[1]
    for term in ["new tokens in", "tok/s", "model calls N (+M draft)", "tokens/call", "mean acceptance length",
                 "exact / approximate sampler"]:
        assert term in epilog, term
    assert "dllm.stats.DecodeStats" in epilog


@pytest.mark.slow
def test_shipped_models_and_heads_by_bare_name_from_any_directory(tmp_path):
    """--drafter drafter, --model two_stream and draft_head=fef_head / two_stream_head / ar_eagle / ar_repair
    resolve to the package's dllm/weights from a working directory that has no dllm/ folder."""
    import subprocess
    import sys

    weights = Path(__file__).resolve().parents[1] / "dllm" / "weights"
    names = ("ar", "diffusion", "drafter", "two_stream", "fef_head", "two_stream_head", "ar_eagle", "ar_repair")
    if not all((weights / name / "model.safetensors").exists() for name in names):
        pytest.skip("shipped weights not present")
    runs = [["--sampler", "ar_spec", "--drafter", "drafter"],
            ["--option", "draft=head", "--option", "draft_head=fef_head"],
            ["--model", "two_stream", "--option", "draft=head", "--option", "draft_head=two_stream_head"],
            ["--sampler", "ar_spec", "--option", "drafter=head", "--option", "draft_head=ar_eagle"],
            ["--sampler", "ar_spec", "--drafter", "diffusion", "--option", "draft_head=ar_repair"]]
    code = ("import json, sys\nfrom dllm.cli import main\n"
            f"for flags in {runs!r}:\n"
            "    assert main(['generate', 'Tom has 3 bags', '--max-new-tokens', '8', '--json', *flags]) == 0, flags\n")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(outputs) == len(runs) and all(out["stats"]["new_tokens"] > 0 for out in outputs)
    assert list(tmp_path.iterdir()) == []
