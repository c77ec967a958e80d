#!/usr/bin/env bash
# One-shot GPU check for the fused kernels, sized to finish in under 8 minutes on one
# H200: (1) the kernel tests on CUDA tensors with the compiled kernels (VERL_DS_KERNELS=triton,
# no interpreter), (2) the benchmark at its default (large) shapes with forward+backward and a launch-shape
# sweep. Output goes to stdout and to $OUT (or runs/gpu_check/) as text and JSON.
#
#   bash benchmarks/gpu_check.sh                 # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
export TRITON_INTERPRET=0 VERL_DS_KERNELS=triton PYTHONWARNINGS=ignore::FutureWarning OMP_NUM_THREADS=4
start=$(date +%s)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch in $PY sees no CUDA device; run this on a GPU machine with a CUDA torch" >&2
    exit 2
fi
if ! "$PY" -c "import verl_ds.kernels" 2>/dev/null; then
    # install in place, offline
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: cannot install verl_ds" >&2; exit 2; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT_DIR/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    | tee -a "$OUT_DIR/gpu.txt"

echo "== kernel tests on CUDA (compiled kernels) =="
timeout 210 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --durations=8 2>&1 | tee "$OUT_DIR/tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "tests exit code: $tests_rc (after $(( $(date +%s) - start )) s)"

echo "== benchmark (issue shapes, bf16, forward and forward+backward, sweep) =="
left=$(( 450 - ($(date +%s) - start) ))
timeout "$left" "$PY" benchmarks/kernels.py --backward --sweep --json "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "benchmark exit code: $bench_rc; total $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
