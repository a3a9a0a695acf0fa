#!/usr/bin/env bash
# One-shot GPU check (no network, < 5 minutes on one H200): the CUDA tests, then the side-by-side
# CUDA benchmark. Full logs go to $OUT when set, else ./gpu_check_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to $PY" >&2
  exit 2
fi
"$PY" -c "import hot_compile" 2>/dev/null || "$PY" -m pip install --quiet --no-deps -e . >"$OUT/install.log" 2>&1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
status=0
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 240 "$PY" tools/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
