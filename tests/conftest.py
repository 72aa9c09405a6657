import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any test module imports
# one; without CUDA the kernels can only run in the interpreter.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
