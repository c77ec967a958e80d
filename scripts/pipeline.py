#!/usr/bin/env python
"""The whole pipeline on the built-in parity task, on CPU (``make pipeline``):

1. SFT on the task's demonstrations (``verl-ds sft``), briefly: the policy learns the answer's form, not yet which
   digits the instruction asks for;
2. a reward model, from the SFT model (``verl-ds rm``), on preference pairs ranked by the task's rule: half the
   task's generated pairs, half the SFT model's own samples (four per prompt, best vs worst), so that it also knows
   the ill-formed responses PPO starts from; its accuracy on held-out pairs (other prompts) is ``rm_accuracy``;
3. PPO from the SFT model with that reward model as ``reward.model_path`` and no rule reward
   (``reward.functions: []``; a fixed KL coefficient keeps the policy where the reward model was trained); the
   rule's score of the sampled responses is watched, never used:
   ``ppo_rise`` = its mean over the last 10% of steps minus its mean over the first 10%;
4. DPO from the SFT model on the same pairs, the alternative last step (``verl-ds dpo``): ``dpo_rise`` = the rule
   score of responses sampled from the DPO model minus that of the SFT model, on held-out prompts.

Each job runs in this process through the classes the commands run, with the overrides printed as the command
line that runs it alone. The last line is ``pipeline rm_accuracy=<a> ppo_rise=<b> dpo_rise=<c>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# every job: one rank, ZeRO-3 as the defaults, the default job's lengths (each job's completion limit is its own key)
COMMON = ["data.max_prompt_length=16", "trainer.loggers=[]", "trainer.resume=none"]
COMPLETION_TOKENS = 8
# the tiny Llama of configs/default.yaml, built from config by the SFT job only: the later jobs start from its export
# (model.path), whose config.json defines the model (verl-ds refuses model.config_overrides with model.path)
SHAPE = ["model.config_overrides.hidden_size=64", "model.config_overrides.intermediate_size=128",
         "model.config_overrides.num_hidden_layers=2"]
HELD_OUT_SEED = 777  # prompts for the rule scores of the SFT and DPO models: none of the jobs trains on them


def config(out: str, name: str, overrides: list):
    from verl_ds.config import load_config

    args = [*COMMON, f"trainer.output_dir={os.path.join(out, name)}", *overrides]
    print(f"\n== {name}: {' '.join(args)}", flush=True)
    return load_config(None, args)


def run_stage(job_name: str, out: str, overrides: list) -> dict:
    """A supervised-style job (sft, rm, dpo) as ``verl-ds <job_name>`` runs it; returns its summary."""
    from verl_ds.dist import detect_launch
    from verl_ds.stages.gate import check_stage
    from verl_ds.stages.spine import format_summary

    import importlib

    job_cls = importlib.import_module(f"verl_ds.stages.{job_name}").JOB
    cfg = config(out, job_name, [f"{job_name}.max_completion_length={COMPLETION_TOKENS}", *overrides])
    launch = detect_launch({})
    check_stage(cfg, launch.world_size, launch.rank, job=job_name)  # the gate of `verl-ds <job_name>`
    summary = job_cls(cfg, launch).fit()
    print(format_summary(summary), flush=True)
    return summary


def run_ppo(out: str, overrides: list) -> list:
    """The RL job (``launch/train.py``) with the learned reward model; returns the rule score of each step's
    sampled responses (read from the rollouts, not part of the reward)."""
    from verl_ds.builder import load_data
    from verl_ds.dist import detect_launch
    from verl_ds.report import format_summary
    from verl_ds.tasks import parity
    from verl_ds.trainer import Trainer

    cfg = config(out, "ppo", [f"rollout.max_new_tokens={COMPLETION_TOKENS}", *overrides])
    trainer = Trainer(cfg, detect_launch({}), data=load_data(cfg))
    inner, scores = trainer.rollout_fn, []

    def watched(*args, **kwargs):
        rollout = inner(*args, **kwargs)
        if not kwargs.get("greedy"):  # the step's samples; greedy calls are validation
            rule = parity.parity_reward(rollout.batch.extras["prompt"], rollout.responses)
            scores.append(sum(rule) / len(rule))
        return rollout

    trainer.rollout_fn = watched
    print(format_summary(trainer.fit()), flush=True)
    return scores


def sampled_rule_score(model_dir: str, n: int, seed: int, max_new_tokens: int = 8) -> float:
    """The mean rule score of one response sampled (temperature 1, no truncation) per held-out prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_ds.tasks import parity

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = parity.generate_prompts(n, seed)
    total = 0.0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, n, 128):
            chunk = records[i:i + 128]
            enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            total += sum(parity.score(t, r["target"]) for t, r in zip(texts, chunk))
    return total / n


def sample(model_dir: str, prompts: list, k: int, seed: int, max_new_tokens: int = 8) -> list:
    """``k`` responses sampled (temperature 1) from the model in ``model_dir`` for each prompt, as decoded text up to
    its first EOS (special tokens kept, so the rule sees what was emitted)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(prompts), 256):
            enc = tok(prompts[i:i + 256], return_tensors="pt", padding=True)
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=k,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            out += [[t.split(tok.eos_token)[0].strip() for t in texts[j:j + k]] for j in range(0, len(texts), k)]
    return out


def write_pairs(path: str, model_dir: str, n: int, seed: int) -> str:
    """Preference pairs for ``n`` prompts: half the task's generated pairs, half the policy's own samples (four per
    prompt from ``model_dir``, the best by the rule chosen, the worst rejected, ties dropped): a reward model then
    also knows the responses PPO starts from, not only well-formed ones."""
    import json

    from verl_ds.tasks import parity

    rows = parity.preference_pairs(n // 2, seed)
    records = parity.generate_prompts(n - n // 2, seed + 1)
    for record, responses in zip(records, sample(model_dir, [r["prompt"] for r in records], 4, seed)):
        ranked = sorted(responses, key=lambda t: parity.score(t, record["target"]))
        lo, hi = ranked[0], ranked[-1]
        if parity.score(hi, record["target"]) > parity.score(lo, record["target"]) and lo.strip() and hi.strip():
            rows.append({"prompt": record["prompt"], "chosen": hi, "rejected": lo})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def rise(scores: list) -> float:
    """Mean of the last 10% of ``scores`` minus the mean of the first 10% (at least one each)."""
    k = max(1, len(scores) // 10)
    return sum(scores[-k:]) / k - sum(scores[:k]) / k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=os.path.join(ROOT, "runs", "pipeline"))
    p.add_argument("--sft-steps", type=int, default=12)
    p.add_argument("--rm-steps", type=int, default=200)
    p.add_argument("--ppo-steps", type=int, default=100)
    p.add_argument("--dpo-steps", type=int, default=60)
    p.add_argument("--eval-prompts", type=int, default=512)
    p.add_argument("--pairs", type=int, default=4096, help="training preference pairs' prompts (RM and DPO)")
    p.add_argument("--val-pairs", type=int, default=512, help="held-out preference pairs' prompts")
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--ppo-lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out, t0 = args.output_dir, time.perf_counter()

    sft = run_stage("sft", out, [*SHAPE, f"trainer.total_steps={args.sft_steps}", "trainer.val_every=0",
                                 "actor.lr=1e-3"])
    sft_model = sft["export_dir"]
    train_pairs = write_pairs(os.path.join(out, "pairs", "train.jsonl"), sft_model, args.pairs, seed=1)
    val_pairs = write_pairs(os.path.join(out, "pairs", "val.jsonl"), sft_model, args.val_pairs, seed=2)
    data = [f"data.train_files={train_pairs}", f"data.val_files={val_pairs}"]
    rm = run_stage("rm", out, [f"model.path={sft_model}", f"trainer.total_steps={args.rm_steps}", "actor.lr=1e-3",
                               *data])
    rm_accuracy = rm["val_end"]["val/accuracy"]
    ppo_scores = run_ppo(out, [f"model.path={sft_model}", f"reward.model_path={rm['export_dir']}",
                               "reward.functions=[]", f"trainer.total_steps={args.ppo_steps}", "trainer.val_every=0",
                               "algo.kl_ctrl=fixed", f"algo.kl_coef={args.kl_coef}",
                               f"actor.lr={args.ppo_lr}", "trainer.export=none"])
    ppo_rise = rise(ppo_scores)
    print(f"ppo: rule score of the sampled responses by step: "
          f"{' '.join(f'{s:.2f}' for s in ppo_scores)}", flush=True)
    dpo = run_stage("dpo", out, [f"model.path={sft_model}", f"trainer.total_steps={args.dpo_steps}", "actor.lr=1e-3",
                                 "dpo.beta=0.1", *data])
    before = sampled_rule_score(sft_model, args.eval_prompts, HELD_OUT_SEED)
    after = sampled_rule_score(dpo["export_dir"], args.eval_prompts, HELD_OUT_SEED)
    dpo_rise = after - before
    print(f"dpo: rule score of sampled responses on {args.eval_prompts} held-out prompts: SFT model {before:.3f}, "
          f"DPO model {after:.3f}", flush=True)
    print(f"pipeline time {time.perf_counter() - t0:.0f}s", flush=True)
    print(f"pipeline rm_accuracy={rm_accuracy:.3f} ppo_rise={ppo_rise:.3f} dpo_rise={dpo_rise:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    from verl_ds.cli import explained

    # a job's start-up refusal (a ConfigError) is one "verl_ds: error:" line and exit 2, as the verl-ds commands give
    sys.exit(explained(main))
