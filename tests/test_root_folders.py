"""The top-level folders `kernels/`, `samplers/` and `eval/` never shadow a distribution of the same name.

Python run from the repository root (`python -m pytest`, `python -m dllm`, a script there) puts the root first on
sys.path. Today's transformers imports Hugging Face's `kernels` from its model classes, so a folder answering
`import kernels` breaks every model class (dllm/_root_folders.py).
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "samplers", "eval")


def _python(code: str, *, cwd: Path = ROOT, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:  # after the root: the root (cwd, sys.path[0]) is searched first
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_a_distribution_of_each_name_wins_over_the_folder(tmp_path):
    for name in FOLDERS:  # stand-ins for other distributions named like the folders, searched after the root
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'the other {name}'\n")
        (tmp_path / name / "part.py").write_text("PART = 1\n")
    result = _python("""
        import eval, kernels, samplers
        from kernels.part import PART
        print(kernels.WHO, samplers.WHO, eval.WHO, PART, sep="|")
        import dllm.eval, dllm.kernels, dllm.samplers
        assert callable(dllm.kernels.verify_logits) and "fef" in dllm.samplers.SAMPLERS and callable(dllm.eval.get_task)
        import sys
        assert sys.modules["kernels"] is kernels and sys.modules["dllm.kernels"] is not kernels
        print("ours as dllm.*")
    """, extra_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["the", "other", "kernels|the", "other", "samplers|the", "other", "eval|1",
                                     "ours", "as", "dllm.*"]


def test_without_such_a_distribution_the_bare_name_is_not_found():
    missing = [name for name in FOLDERS if not _installed(name)]
    if not missing:
        pytest.skip("every folder's name is installed as a distribution here")
    result = _python(f"""
        import importlib
        for name in {missing!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                assert error.name == name, error.name
                print(error)
            else:
                raise SystemExit(f"import {{name}} answered the repository's folder")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in missing:
        assert f"No module named {name!r}" in result.stdout and f"'dllm.{name}'" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None or not _installed("kernels"),
                    reason="Hugging Face's kernels distribution is not installed (transformers < 5 does not need it)")
def test_transformers_model_classes_import_from_the_root():
    # The failure a fresh install met: transformers 5 imports `kernels` (CUDAProperties) from its model classes.
    result = _python("""
        from transformers import LlamaForCausalLM
        import kernels
        print(kernels.__file__)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not Path(result.stdout.strip()).resolve().is_relative_to(ROOT)


def test_python_m_dllm_runs_from_the_root():
    result = subprocess.run([sys.executable, "-m", "dllm", "--version"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["dllm", importlib.metadata.version("dllm")]


def test_plain_pytest_finds_the_test_helpers():
    # `pytest` (the console script) puts tests/ on sys.path, not the root: a test importing `tests.x` is found only
    # by `python -m pytest`. Every test module imports its helpers by their own names.
    import ast

    offending = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offending += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] == "tests"]
    assert not offending, offending
    pytest_script = Path(sys.executable).with_name("pytest")
    if not pytest_script.exists():
        pytest.skip(f"no pytest console script beside {sys.executable}")
    result = subprocess.run([str(pytest_script), "-q", "-p", "no:cacheprovider", "--collect-only",
                             "tests/test_fef_chain.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
