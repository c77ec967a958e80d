# Two commands on a fresh machine: `make run` (the default PPO job) and `make test` (the test suite).
# Each installs what it needs into .venv first (scripts/bootstrap.sh, idempotent).
SHELL := /bin/bash
export DS_ACCELERATOR := cpu
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_ext
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export PYTHONWARNINGS := ignore::FutureWarning

.PHONY: install run test bench

install:
	bash scripts/bootstrap.sh

run: install
	.venv/bin/python launch/train.py

test: install
	.venv/bin/python -m pytest -q tests

bench: install
	.venv/bin/python benchmarks/numerics.py
