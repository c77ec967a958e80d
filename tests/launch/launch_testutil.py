"""Helpers for the launcher tests: tiny local HF model directories and subprocess runs of the job under
each launcher (2 ranks, gloo, with timeouts). Named *_testutil so it never clashes with another conftest."""
from __future__ import annotations

import glob
import json
import os
import subprocess

from e2e_utils import FAST, ROOT, base_env, free_port, read_metrics  # noqa: F401  (re-exported)

CONFIGS = os.path.join(ROOT, "configs")
GPU_CONFIG = os.path.join(CONFIGS, "qwen2.5-0.5b-gsm8k.yaml")
CPU_ACCELERATE = os.path.join(CONFIGS, "accelerate", "deepspeed_zero3_cpu.yaml")
# metrics that legitimately differ between runs
NONDETERMINISTIC = ("timing_s/", "perf/")

# Qwen2.5-0.5B-Instruct's architecture (its config.json, without weights: plan reads nothing else)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                 max_position_embeddings=32768)


def job_configs() -> list[str]:
    """Every job config shipped in configs/ (YAML at the top level)."""
    return sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))


def config_only_dir(path, **arch) -> str:
    """A directory holding just a Qwen2 config.json (enough for AutoConfig and `plan`)."""
    from transformers import Qwen2Config

    os.makedirs(path, exist_ok=True)
    Qwen2Config(**arch).save_pretrained(path)
    return str(path)


def tiny_qwen_dir(path) -> str:
    """A tiny Qwen2 causal LM with tied embeddings (like Qwen2.5-0.5B) and the built-in tokenizer, saved
    with save_pretrained: a local HF directory to point model.path at."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(cmd: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; a failure shows the tail of both streams."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n--- stdout ---\n"
                             f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def step_metrics(output_dir: str) -> list[dict]:
    """The training-step lines of metrics.jsonl without the keys that vary from run to run."""
    return [{k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC)}
            for m in read_metrics(output_dir) if "rollout/score/mean" in m]


def dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
