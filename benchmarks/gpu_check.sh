#!/usr/bin/env bash
# One-shot GPU check, under 8 minutes on one GPU shared by several ranks:
#   1. `hpctp info` on 2 ranks (GPU per rank, CUDA-aware detection);
#   2. the device-block tests (tests/test_device_blocks.py: torch CUDA and cupy blocks through the
#      comm layer, core ops, SUMMA, halo, nn layers, HDF5; staged, and CUDA-aware where the MPI
#      reports it) plus the comm tests, on 1, 2 and 4 ranks;
#   3. where the MPI library is not CUDA-aware: the CUDA-aware kinds of those tests on 2 and 4 ranks,
#      device memory allocated as CUDA managed memory (benchmarks/managed_alloc.c) that MPI can read;
#   4. benchmarks/gpu_bench.py on 4 ranks: SUMMA and halo-conv ratios against torch on one GPU.
# Every step gets what is left of one time budget (GPU_CHECK_BUDGET seconds, default 450), so the
# script always ends and prints its summary.
#
# Usage, from the repository root, in an environment with torch (CUDA), numpy, h5py, pytest:
#   benchmarks/gpu_check.sh                 # on the GPU machine
#   GPU_CHECK_DEVICE=cpu benchmarks/gpu_check.sh   # a dry run of this script without a GPU
# Missing mpi4py / MPI / pytest-mpi: run benchmarks/gpu_wheels.sh on a machine with PyPI first;
# the wheels it leaves in .whl/ are installed from there into $GPU_CHECK_PREFIX (no network needed).
# The log also goes to $OUT/gpu_check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")  # absolute: Open MPI launched by full path puts its own bin/ first on PATH
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET:-450}
PREFIX=${GPU_CHECK_PREFIX:-/tmp/hpctp-gpu-env}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${OUT:-}" ]; then exec > >(tee "$OUT/gpu_check.log") 2>&1; fi
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
status=0
declare -a SUMMARY

step() {  # step NAME CMD...: run CMD with what is left of the budget, record the outcome
  local name=$1; shift
  local t0=$SECONDS rem rc
  rem=$(left)
  if [ "$rem" -lt 15 ]; then SUMMARY+=("SKIP  $name (budget spent)"); status=1; return; fi
  echo "=== $name (up to ${rem}s) ==="
  timeout -k 5 "$rem" "$@"
  rc=$?
  if [ $rc -eq 0 ]; then SUMMARY+=("ok    $name ($((SECONDS - t0))s)")
  else SUMMARY+=("FAIL  $name (exit $rc$([ $rc -eq 124 ] && echo ', timed out'), $((SECONDS - t0))s)"); status=1; fi
}

# --- environment: install carried wheels (.whl/) for what is missing: an MPI with its launcher and
# mpi4py (an mpi4py that imports and an mpiexec on PATH are kept: the site MPI may be CUDA-aware),
# and pytest-mpi
need=()
if ! { "$PY" -c "import mpi4py.MPI" 2>/dev/null && command -v "${MPIEXEC:-mpiexec}" >/dev/null; }; then
  need+=(mpich mpi4py)
fi
"$PY" -c "import pytest_mpi" 2>/dev/null || need+=(pytest_mpi)
if [ ${#need[@]} -gt 0 ]; then
  wheels=()
  for w in "${need[@]}"; do wheels+=(.whl/"$w"-*.whl); done
  echo "gpu_check: installing ${need[*]} from .whl/ into $PREFIX"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix "$PREFIX" "${wheels[@]}" ||
    { echo "gpu_check: missing ${need[*]}; run benchmarks/gpu_wheels.sh where PyPI is reachable"; exit 1; }
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$PREFIX', 'platbase': '$PREFIX'}))")
  export PYTHONPATH="$PYTHONPATH:$site" PATH="$PREFIX/bin:$PATH" LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || echo mpiexec)}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}  # MPICH: ranks may outnumber cores
# Open MPI: GPU machines often run the check as root, which mpiexec refuses unless told
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}

echo "gpu_check: device $DEVICE, budget ${BUDGET}s, $("$PY" --version 2>&1), mpiexec $MPIEXEC"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || { echo "no GPU: stop"; exit 1; }
  BENCH=(--n "${GPU_CHECK_N:-16384}" --field "${GPU_CHECK_FIELD:-4096}")
else
  BENCH=(--device cpu --n 256 --field 64 --reps 1)
fi

step "hpctp info, 2 ranks" "$MPIEXEC" -n 2 "$PY" -m hpctp info
# GPU_CHECK_TESTS: the pytest arguments of this step (the dry run of tests/test_benchmarks.py names a few tests:
# the main suite runs these files on the CPU anyway)
read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/test_device_blocks.py tests/test_comm.py}"
for n in 1 2 4; do
  step "device-block and comm tests, $n rank(s)" "$MPIEXEC" -n "$n" tests/rank0_stdout.sh "$PY" -m pytest -q --with-mpi \
    --timeout=120 "${TESTS[@]}"
done
# The CUDA-aware path (device buffers handed to MPI, nothing staged) where the MPI library is not
# CUDA-aware: torch and cupy allocate managed memory (benchmarks/managed_alloc.c), which that MPI
# can read and write; Open MPI's single-copy (CMA) transport cannot, so it copies through shared memory.
aware_query='import sys, hpctp.comm as c; sys.exit(not c.cuda_aware_reason(override=False)[0])'
if [ "$DEVICE" = cuda ] && ! "$PY" -c "$aware_query"; then
  so=/tmp/hpctp_managed_alloc.so
  NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  if "$NVCC" -shared -Xcompiler -fPIC -cudart shared -o "$so" benchmarks/managed_alloc.c; then
    for n in 2 4; do
      step "CUDA-aware path on managed memory, $n ranks" env HPCTP_TEST_MANAGED_ALLOC="$so" \
        OMPI_MCA_btl_vader_single_copy_mechanism=none "$MPIEXEC" -n "$n" tests/rank0_stdout.sh "$PY" -m pytest \
        -q --with-mpi --timeout=120 tests/test_device_blocks.py -k aware
    done
  else
    SUMMARY+=("FAIL  building benchmarks/managed_alloc.c with $NVCC"); status=1
  fi
fi
step "gpu_bench.py, 4 ranks" "$MPIEXEC" -n 4 "$PY" benchmarks/gpu_bench.py "${BENCH[@]}" "$@"

echo "=== summary ($((SECONDS - START))s of ${BUDGET}s) ==="
printf '%s\n' "${SUMMARY[@]}"
exit $status
