#!/usr/bin/env bash
# The whole GPU check of the kernels in one short run, for a lent machine with CUDA, PyTorch and Triton already
# installed (nothing is downloaded): the kernel benchmark at LLaDA-scale shapes, then the kernel tests at
# full size (CUDA: V = 126464, the samplers with the kernels dispatched).
#
#   bash kernels/gpu_check.sh OUT     # writes OUT/{env.txt,install.log,bench.json,bench.log,pytest.log}
#
# Every step has its own time limit (BENCH_TIMEOUT, TEST_TIMEOUT seconds) so one hang cannot eat the
# lease; bench.json is rewritten after every case, so a cut-off run still reports what it measured.
set -uo pipefail

OUT=${1:?usage: bash kernels/gpu_check.sh OUT}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
            "cuda", torch.version.cuda, torch.cuda.get_device_name())' 2>&1
} > "$OUT/env.txt"

# The project's package only (its dependencies are the machine's own; no network there).
"$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed: dllm.kernels cannot be imported" >> "$OUT/install.log"

timeout "${BENCH_TIMEOUT:-300}" "$PY" -m dllm.kernels.bench --output "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit status $?" >> "$OUT/bench.log"

timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  tests/test_kernel_dispatch.py > "$OUT/pytest.log" 2>&1
echo "pytest exit status $?" >> "$OUT/pytest.log"
tail -n 3 "$OUT/bench.log" "$OUT/pytest.log"
