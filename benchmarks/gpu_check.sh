#!/usr/bin/env bash
# One-shot GPU check (< 8 minutes on one H200, several ranks sharing it): the CUDA tests on 1, 2 and
# 4 ranks (host staging and, if the MPI supports it, CUDA-aware), then the GPU benchmark ratios.
# Usage (repository root, an environment with hpctp, mpi4py and a CUDA torch): benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -m hpctp info
status=0
for n in 1 2 4; do
  echo "=== CUDA tests, $n ranks ==="
  timeout 240 "$MPIEXEC" -n "$n" "$PY" -m pytest -q --with-mpi -p no:cacheprovider \
    tests/test_gpu.py tests/test_conv.py -k "cuda" || status=1
done
echo "=== benchmark, 4 ranks on the GPU(s) ==="
timeout 240 "$MPIEXEC" -n 4 "$PY" benchmarks/gpu_bench.py "$@" || status=1
exit $status
