"""The evaluate metric modules load offline from the package and agree with the task scorers."""

import pytest

from dllm.eval.metrics import METRICS, load_metric, metric_path


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Offline mode, both in the environment and in evaluate's config (read once, at its import)."""
    for name in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    import evaluate.config

    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)


def test_metric_paths_exist():
    for name in METRICS:
        assert metric_path(name).endswith(f"{name}/{name}.py")
    with pytest.raises(ValueError, match="unknown metric"):
        metric_path("code_eval")


def test_gsm8k_accuracy_module():
    metric = load_metric("gsm8k_accuracy")
    result = metric.compute(
        predictions=["So she pays $1,200.00.\n#### 1200", "I think it is 7 or 8", "#### 3\nso 4"],
        references=["... #### 1,200", "#### 8", "3"],
    )
    # The third is right by its stated answer (3), wrong by lm-eval's last number (4).
    assert result == {
        "accuracy": 1.0,
        "strict_accuracy": pytest.approx(2 / 3),
        "lm_eval_strict_match": pytest.approx(2 / 3),
        "lm_eval_flexible_extract": pytest.approx(2 / 3),
    }


def test_math_accuracy_module():
    metric = load_metric("math_accuracy")
    result = metric.compute(
        predictions=[r"so $\boxed{0.5}$", r"\boxed{\frac{1}{3}}", "no answer"],
        references=[r"\frac{1}{2}", r"Hence \boxed{\dfrac{1}{3}}.", "2"],
    )
    assert result == {"accuracy": pytest.approx(2 / 3)}


def test_code_pass_at_k_module_runs_in_the_sandbox():
    metric = load_metric("code_pass_at_k")
    result = metric.compute(
        predictions=[["def f():\n    return 1", "def f():\n    return 2"], ["def g():\n    while True: pass"] * 2],
        references=["assert f() == 1", "assert g() is None"],
        k=[1, 2],
        timeout=1.0,
    )
    assert result == {"pass@1": pytest.approx(0.25), "pass@2": pytest.approx(0.5)}


def test_metric_info_reads_as_written():
    """The texts reach evaluate's info at the margin, and the column types are each metric's own."""
    code, gsm8k = load_metric("code_pass_at_k"), load_metric("gsm8k_accuracy")
    assert code.description.startswith("\nUnbiased pass@k (Chen et al. 2021)") and "\n    " not in code.description
    assert code.citation.startswith("\n@article{chen2021codex,\n  title=")
    assert code.inputs_description.startswith("\nArgs:\n    predictions: list of candidate lists")
    assert code.features["predictions"].feature.dtype == "string" and gsm8k.features["predictions"].dtype == "string"
    assert type(code).__doc__.startswith(code.description + code.inputs_description)
