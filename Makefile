# Two commands on a fresh machine: `make run` (the default PPO job) and `make test` (the test suite).
# Each installs what it needs first (idempotent): .venv (scripts/bootstrap.sh); `make test` also the vLLM
# venv .venv-vllm (scripts/install_vllm.sh, ~2 min), where the vLLM tests run, and bubblewrap (the sandbox).
SHELL := /bin/bash
export DS_ACCELERATOR := cpu
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_ext
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export PYTHONWARNINGS := ignore::FutureWarning

.PHONY: install install-vllm install-sandbox run test bench pipeline

install:
	bash scripts/bootstrap.sh

install-vllm:
	bash scripts/install_vllm.sh

run: install
	.venv/bin/python launch/train.py

# bubblewrap, the sandbox of model-written code: apt-get install when missing (root), else a warning (.ci/run)
install-sandbox:
	bash .ci/run sandbox

test: install install-vllm install-sandbox
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=40 tests

bench: install
	.venv/bin/python benchmarks/numerics.py

# SFT -> reward model -> PPO on the learned reward model, and DPO as the alternative last step (docs/stages.md);
# PIPELINE_ARGS: scripts/pipeline.py's flags (tests/stages/test_pipeline.py runs a short one: --sft-steps 2 ...)
pipeline: install
	.venv/bin/python scripts/pipeline.py $(PIPELINE_ARGS)
