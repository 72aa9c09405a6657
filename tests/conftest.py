import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any test module imports
# one; without CUDA the kernels can only run in the interpreter.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Ctrl-C tests need SIGINT's usual disposition. A shell that starts pytest as a background job (`cmd &`)
# hands it SIGINT ignored, which Python then leaves ignored, in this process and in every child it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
