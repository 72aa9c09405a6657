"""Install: triton is the [gpu] extra, and a CPU install imports and decodes without it."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter where triton cannot be imported, as on a CPU install without the extra:
# find_spec("triton") answers None (what kernels.dispatch asks) and any import of triton.* fails.
WITHOUT_TRITON = r"""
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
sys.modules["triton"] = None

import torch
import dllm, dllm.cli, dllm.kernels, dllm.eval.study.bench, dllm.eval.runner
from dllm.kernels.dispatch import triton_installed
assert not triton_installed()
oracle = dllm.HMMOracle.random(num_states=3, num_tokens=5, seed=0)
prompt = torch.tensor([[0, 1], [2, 3]])
for sampler, model in [("fef", oracle), ("sequential", oracle), ("llada", oracle), ("fast_dllm", oracle),
                       ("ar", oracle.as_causal()), ("ar_spec", oracle.as_causal())]:
    for temperature in (0.0, 1.0):
        out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=6, temperature=temperature,
                            generator=torch.Generator().manual_seed(0))
        assert out.sequences.shape == (2, 8), sampler
assert dllm.cli.main(["generate", "Tom has 3 bags", "--max-new-tokens", "8", "--json"]) == 0
assert sys.modules["triton"] is None and not any(m.startswith("triton.") for m in sys.modules)
print("cpu paths ran without triton")
"""


def test_triton_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    # a CPU install of [test] stays without triton (about 1 GB); the kernel tests skip their Triton halves there
    assert any(d.startswith("triton") for d in extras["gpu"])
    assert not any(d.startswith("triton") for d in extras["test"])
    assert {"eval", "bench", "test", "gpu", "docs"} <= set(extras)
    assert project["scripts"]["dllm-lm-eval"] == "dllm.eval.lm_eval_cli:main"


def test_every_package_folder_is_listed_for_the_wheel():
    # an editable install finds a subpackage through its parent's folder; a wheel holds only the listed ones
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *parts))
            data = parts[:1] == ("weights",) or (parts[:1] == ("metrics",) and len(parts) > 1)  # package data
            if not data:
                assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is missing from pyproject's packages"


def test_cpu_paths_run_without_triton():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DLLM_KERNELS": "auto"}
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cpu paths ran without triton" in result.stdout


def test_readme_names_the_cpu_wheel_index_the_extras_and_the_lm_eval_script():
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    for extra in ("[eval]", "[bench]", "[test]", "[gpu]"):
        assert extra in readme, extra
    assert "dllm-lm-eval" in readme and "lm_eval --model dllm" in readme
