import inspect
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any test module imports
# one; without CUDA the kernels can only run in the interpreter.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Ctrl-C tests need SIGINT's usual disposition. A shell that starts pytest as a background job (`cmd &`)
# hands it SIGINT ignored, which Python then leaves ignored, in this process and in every child it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _logprobs_in_exactness_tests(request, monkeypatch):
    """In the modules that test laws by chi-square, every generate run also returns its log-probabilities, which
    ``stat_tools.chi_square_pvalue`` then checks against the law (``stat_tools.check_logprobs``)."""
    if not any(hasattr(request.module, name) for name in ("chi_square_pvalue", "check_native_chain")):
        yield
        return
    import dllm
    import dllm.api

    import stat_tools

    real = dllm.api.generate
    signature = inspect.signature(real)

    def generate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = {**bound.arguments.pop("options", {}), **bound.arguments}
        if arguments.get("sampler", "fef") != "native" and "logprobs" not in arguments:
            arguments["logprobs"] = True
        out = real(**arguments)
        stat_tools.remember_run(out, arguments["model"], arguments["input_ids"], arguments)
        return out

    monkeypatch.setattr(dllm, "generate", generate)
    yield
    stat_tools.RECENT_RUNS.clear()
