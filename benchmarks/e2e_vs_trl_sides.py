"""The two sides of ``benchmarks/e2e_vs_trl.py``, each run in an interpreter of its own: verl_ds's
``launch/train.py`` job (``--verl-ds-worker``, which also times each step and phase in process CPU seconds) and TRL's
``GRPOTrainer`` on the same job (``--trl-worker``), and the functions that start them and read back one row per
step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # verl_ds from this checkout, installed or not
PHASES = ("boundary", "gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "weight_sync", "kl_ctrl")
ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning", "TRANSFORMERS_VERBOSITY": "error",
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}


def _run(cmd: list, threads: int, what: str, timeout: float) -> float:
    env = dict(os.environ, **ENV, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def run_verl_ds(job: dict, zero_stage: int, out: str, timeout: float, extra: tuple = ()) -> tuple[list[dict], float]:
    """launch/train.py on the job (1 process), with ``extra`` overrides last; returns (one row per step, process
    wall seconds)."""
    beta = job["beta"]
    args = [f"model.path={job['model_dir']}", f"data.train_files={job['prompts']}", "data.max_prompt_length=16",
            f"rollout.batch_size={job['prompts_per_step']}", f"rollout.n={job['n']}",
            f"rollout.max_new_tokens={job['max_new_tokens']}", f"rollout.temperature={job['temperature']}",
            "rollout.top_k=0", "rollout.top_p=1.0", f"actor.lr={job['lr']}",
            f"actor.mini_batch_size={job['prompts_per_step'] * job['n']}",
            f"actor.micro_batch_size={job['micro_batch']}", "actor.ppo_epochs=1", "actor.grad_clip=1.0",
            "actor.weight_decay=0.0", "algo.adv_estimator=grpo", "algo.kl_placement=loss", "algo.kl_kind=low_var_kl",
            f"algo.kl_coef={beta}", "algo.kl_ctrl=fixed", f"algo.use_kl_penalty={str(beta > 0).lower()}",
            "algo.clip_ratio_c=null", "algo.loss_agg_mode=token-mean", "algo.entropy_coef=0.0", "model.dtype=fp32",
            f"deepspeed.zero_stage={zero_stage}", f"trainer.total_steps={job['steps']}", f"trainer.seed={job['seed']}",
            f"trainer.output_dir={out}", "trainer.resume=none", "trainer.loggers=[]",
            "trainer.export=none", "trainer.val_every=0"]
    if job.get("log_prob_micro_batch"):  # the no-grad passes in TRL's chunks (else verl_ds's default, 64 samples)
        args.append(f"rollout.log_prob_micro_batch_size={job['log_prob_micro_batch']}")
    given = {o.split("=", 1)[0] for o in extra}  # verl-ds refuses a key given twice: extra replaces the job's
    args = [o for o in args if o.split("=", 1)[0] not in given] + list(extra)
    shutil.rmtree(out, ignore_errors=True)  # a fresh run appends to an old metrics.jsonl in its directory
    cpu_file = os.path.join(out, "cpu_s.json")
    wall = _run([sys.executable, os.path.abspath(__file__), "--verl-ds-worker", cpu_file, *args], job["threads"],
                f"verl_ds (ZeRO-{zero_stage})", timeout)
    with open(cpu_file, encoding="utf-8") as fh:
        cpu = json.load(fh)
    rows = []
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        for m in map(json.loads, fh):
            if "timing_s/step" in m:
                c = cpu[len(rows)]
                rows.append({"step_s": m["timing_s/step"], "tokens": m["perf/total_num_tokens"],
                             "prompt_len": m["prompt_length/mean"], "response_len": m["response_length/mean"],
                             "score": m["rollout/score/mean"], "cpu_s": c["cpu_s"],
                             **{p: m.get(f"timing_s/{p}", 0.0) for p in PHASES},
                             **{f"cpu_{p}": c.get(f"cpu_{p}", 0.0) for p in PHASES}})
    return rows, wall


def verl_ds_worker(cpu_file: str, args: list) -> int:
    """``launch/train.py args`` in this interpreter, with each ``Trainer.train_step`` and each of its timed phases
    (``verl_ds.metrics.Timings``) also measured in process CPU seconds (all threads), which a loaded machine
    inflates far less than wall time; one {"cpu_s", "cpu_<phase>"...} per step is written to ``cpu_file``."""
    from contextlib import contextmanager

    from verl_ds import metrics, trainer
    from verl_ds.cli import main as cli_main

    step, phase = getattr(trainer.Trainer, "train_step", None), getattr(metrics.Timings, "__call__", None)
    if step is None or phase is None:
        raise SystemExit("verl_ds.trainer.Trainer.train_step or verl_ds.metrics.Timings.__call__ is gone: "
                         "update benchmarks/e2e_vs_trl.py")
    rows, current = [], {}

    def timed_step(self):
        current.clear()
        t0 = time.process_time()
        out = step(self)
        rows.append({"cpu_s": time.process_time() - t0, **current})
        return out

    @contextmanager
    def timed_phase(self, name):
        t0 = time.process_time()
        try:
            with phase(self, name):
                yield
        finally:
            current[f"cpu_{name}"] = current.get(f"cpu_{name}", 0.0) + time.process_time() - t0

    trainer.Trainer.train_step, metrics.Timings.__call__ = timed_step, timed_phase
    rc = cli_main(["train", *args])
    os.makedirs(os.path.dirname(cpu_file), exist_ok=True)
    with open(cpu_file, "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    return rc


def run_trl(job: dict, out: str, timeout: float) -> tuple[list[dict], float]:
    """TRL's GRPOTrainer on the job in its own interpreter (``--trl-worker``); returns (rows, wall seconds)."""
    spec = os.path.join(out, "job.json")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({**job, "out": out}, fh)
    wall = _run([sys.executable, os.path.abspath(__file__), "--trl-worker", spec], job["threads"], "TRL", timeout)
    with open(os.path.join(out, "trl_steps.json"), encoding="utf-8") as fh:
        return json.load(fh), wall


def trl_worker(spec_path: str) -> None:
    """Runs in the TRL interpreter: GRPOTrainer with the job's settings; writes one row per step to trl_steps.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_ds.tasks.parity import parity_reward

    with open(spec_path, encoding="utf-8") as fh:
        job = json.load(fh)
    torch.set_num_threads(job["threads"])
    with open(job["prompts"], encoding="utf-8") as fh:
        data = Dataset.from_list([json.loads(line) for line in fh])
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    samples = job["prompts_per_step"] * job["n"]

    def parity(prompts, completions, **_):
        return parity_reward(prompts, completions)

    class StepTimes(TrainerCallback):
        """Seconds from on_step_begin to on_step_end (generation, scoring, every micro-batch, optimizer step)
        and the logged reward / completion length of each optimizer step."""

        def __init__(self):
            self.t0, self.rows, self.logs = 0.0, [], {}

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            self.rows.append({"step_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.c0})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.logs[state.global_step] = logs

    args = GRPOConfig(
        output_dir=job["out"], use_cpu=True, bf16=False, fp16=False, seed=job["seed"], data_seed=job["seed"],
        max_steps=job["steps"], learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, gradient_checkpointing=False,
        per_device_train_batch_size=job["micro_batch"], gradient_accumulation_steps=samples // job["micro_batch"],
        num_generations=job["n"], max_completion_length=job["max_new_tokens"], temperature=job["temperature"],
        top_k=0, top_p=1.0,
        num_iterations=1, beta=job["beta"], use_bias_correction_kl=False, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", disable_dropout=True, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    timer = StepTimes()
    trainer = GRPOTrainer(model=job["model_dir"], reward_funcs=[parity], args=args, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    rows = []
    for i, row in enumerate(timer.rows, start=1):
        logs = timer.logs[i]
        rows.append({**row, "score": logs["reward"], "tokens": logs["completions/mean_length"] * samples,
                     "logs": logs})
    with open(os.path.join(job["out"], "trl_steps.json"), "w", encoding="utf-8") as fh:
        json.dump(rows, fh)



if __name__ == "__main__":
    if sys.argv[1:2] == ["--verl-ds-worker"]:  # the rest are launch/train.py's arguments
        sys.exit(verl_ds_worker(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] == ["--trl-worker"] and len(sys.argv) == 3:
        sys.exit(trl_worker(sys.argv[2]))
    raise SystemExit("usage: e2e_vs_trl_sides.py --verl-ds-worker CPU_FILE [launch/train.py args] | --trl-worker SPEC")
