"""``dllm-lm-eval``: lm-eval's command line with the ``dllm`` model registered.

This entry module imports nothing heavy: torch, transformers and lm-eval load inside the guard of
``dllm.cli.run_guarded``, so Ctrl-C during their seconds of import ends in one line and exit status 130
(as for ``dllm``). The model class lives in ``dllm.eval.lm_eval_plugin``; importing it registers it.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on ``argv`` (default: the process's) with ``--model dllm`` available."""
    from dllm.cli import run_guarded

    def evaluate() -> int:
        from lm_eval.__main__ import cli_evaluate

        import dllm.eval.lm_eval_plugin  # noqa: F401  registers the model with lm-eval

        sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
        cli_evaluate()
        return 0

    return run_guarded("lm-eval", evaluate)


if __name__ == "__main__":
    sys.exit(main())
