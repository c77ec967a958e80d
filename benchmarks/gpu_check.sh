#!/usr/bin/env bash
# The one GPU check, sized for a single H200 in under 10 minutes, each part under its own timeout, figures printed
# as they come and written to $OUT (or runs/gpu_check/) as text and JSON:
#   (a) the kernel tests on CUDA tensors with the compiled kernels (VERL_DS_KERNELS=triton, no interpreter; fp32 and
#       bf16 cases), then benchmarks/kernel_speed.py at its default (large) shapes, forward and forward+backward;
#   (b) benchmarks/gpu_attention_check.py: plain packing, shared prompts and shared prefixes in bf16 against each
#       sequence run alone with sdpa, for model.attn_implementation flash_attention_2 (when flash_attn imports),
#       flex_attention and auto, against the per-sequence loop (model.attn_implementation=sdpa);
#   (c) benchmarks/gpu_grpo_check.py: 3 GRPO steps of a ~0.5B Qwen2 built from config (packing, shared prompts)
#       through launch/train.py, with the loop and with auto: tokens/s, peak memory, the step-time ratio.
# Last line: gpu_check attention_step_ratio=<auto / loop s/step> tokens_per_s=<auto's> peak_mem_gib=<auto's>
# (nan where part (c) did not finish).
#
#   bash benchmarks/gpu_check.sh                 # PYTHON=... to pick the interpreter; SWEEP=1 adds kernel_speed's sweep
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
export TRITON_INTERPRET=0 VERL_DS_KERNELS=triton PYTHONWARNINGS=ignore::FutureWarning OMP_NUM_THREADS=4
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
start=$(date +%s)
TOTAL=590  # seconds for everything; each part gets at most its own cap and what is left of this

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch in $PY sees no CUDA device; run this on a GPU machine with a CUDA torch" >&2
    exit 2
fi
if ! "$PY" -c "import verl_ds.kernels" 2>/dev/null; then
    # install in place, offline
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || { echo "gpu_check: cannot install verl_ds" >&2; exit 2; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT_DIR/gpu.txt"
"$PY" -c "
import torch, triton
try:
    import flash_attn; fa = flash_attn.__version__
except ImportError as exc:
    fa = f'not importable ({exc})'
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'flash_attn', fa)" \
    | tee -a "$OUT_DIR/gpu.txt"

budget() {  # seconds for the next part: its cap, or what is left of TOTAL if less (at least 1)
    local left=$(( TOTAL - ($(date +%s) - start) ))
    (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"
}
part() {  # part NAME CAP command...: run it under its timeout, tee its output, keep its exit code in rc_NAME
    local name=$1 cap; cap=$(budget "$2"); shift 2
    echo "== $name (at most ${cap} s, after $(( $(date +%s) - start )) s) =="
    timeout "$cap" "$@" 2>&1 | tee "$OUT_DIR/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "$name: stopped by its timeout (${cap} s)"
    echo "$name exit code: $rc"
    printf -v "rc_$name" '%s' "$rc"
}

part kernel_tests 80 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --durations=8
sweep=(); [ "${SWEEP:-0}" = 1 ] && sweep=(--sweep)
part kernel_speed 70 "$PY" benchmarks/kernel_speed.py --backward "${sweep[@]}" --json "$OUT_DIR/kernel_speed.json"
part attention 130 "$PY" benchmarks/gpu_attention_check.py --device cuda --json "$OUT_DIR/attention.json"
part grpo 330 "$PY" benchmarks/gpu_grpo_check.py --device cuda --timeout 200 --out "$OUT_DIR"

total=$(( $(date +%s) - start ))
echo "gpu_check parts: kernel_tests=$rc_kernel_tests kernel_speed=$rc_kernel_speed attention=$rc_attention" \
     "grpo=$rc_grpo (exit codes), total $total s"
"$PY" - "$OUT_DIR" "$total" "$rc_kernel_tests" "$rc_kernel_speed" "$rc_attention" "$rc_grpo" <<'EOF'
import json, sys
out, total, *rcs = sys.argv[1:]
json.dump({"total_s": int(total), "exit_codes": dict(zip(("kernel_tests", "kernel_speed", "attention", "grpo"),
                                                         map(int, rcs)))}, open(f"{out}/summary.json", "w"), indent=1)
EOF
last=$(grep -E '^gpu_check attention_step_ratio=' "$OUT_DIR/grpo.txt" 2>/dev/null | tail -1)
echo "${last:-gpu_check attention_step_ratio=nan tokens_per_s=nan peak_mem_gib=nan}"
[ "$rc_kernel_tests" -eq 0 ] && [ "$rc_kernel_speed" -eq 0 ] && [ "$rc_attention" -eq 0 ] && [ "$rc_grpo" -eq 0 ]
