"""verl_ds GRPO against TRL's GRPOTrainer, the same job through both, timed in the same run.

Both sides get the same initial weights (a tiny Llama built by ``verl_ds.engines.build`` and saved once with
``save_pretrained``), the same tokenizer (saved beside it), the same prompt file (the parity task as JSON lines),
the same reward (``verl_ds.tasks.parity.parity_reward``), n samples per prompt, prompts per step, micro-batch,
max_new_tokens, sampling (temperature 1, no top-k/top-p), learning rate (constant, AdamW, grad-norm clip 1.0),
one optimizer step per step (one PPO epoch, on-policy), k3 KL in the loss at a fixed coefficient (TRL ``beta``),
token-mean loss aggregation (TRL ``loss_type="dapo"``) and float32, each side in its own interpreter with the same
OMP_NUM_THREADS. Differences that remain (see benchmarks/README.md): the prompt order (each side's own seeded
shuffle), the group-std epsilon (verl_ds 1e-6, TRL 1e-4), the KL clamp of verl_ds's k3, and the engine
(DeepSpeed vs plain torch). Both skip the old-log-prob pass on an on-policy step (verl_ds:
``actor.reuse_on_policy_log_probs``).

    python benchmarks/e2e_vs_trl.py                          # both sizes: ~10-20 min on 2 loaded CPU cores
    python benchmarks/e2e_vs_trl.py --sizes tiny --steps-tiny 20

Per side it prints seconds per step (median after warm-up), generated (response) tokens per second over the
measured steps, and the mean score of the first and last 10% of steps; then verl_ds's per-phase profile of one
step (median of ``timing_s/<phase>`` from metrics.jsonl) and one ``e2e_vs_trl ...`` line of ratios.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # verl_ds from this checkout, installed or not
# model.* shapes; "30m": hidden 512, 8 layers, MLP 2048, 8 heads (4 KV): about 31M parameters
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "30m": {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
}
PHASES = ("boundary", "gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "weight_sync", "kl_ctrl")
ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning", "TRANSFORMERS_VERBOSITY": "error",
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}


def prepare(work: str, size: str, n_prompts: int, seed: int) -> tuple[str, str, int, int]:
    """Save the size's tiny Llama (verl_ds's own construction and init) with its tokenizer, and the prompt file;
    returns (model_dir, prompts_file, number of parameters, parameters in matrix products: every 2-D weight but
    the input embedding, a lookup)."""
    os.environ.update(ENV)  # quiet HF progress bars and DeepSpeed's accelerator warning here too
    from verl_ds.config import load_config
    from verl_ds.engines.build import build_actor_model, load_tokenizer
    from verl_ds.tasks import parity

    cfg = load_config(overrides=[f"model.{k}={v}" for k, v in SIZES[size].items()])
    tok = load_tokenizer(cfg)  # the built-in task's vocabulary (parity.VOCAB), as the default job uses
    model = build_actor_model(cfg, tok)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = os.path.join(work, f"model_{size}")
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts = parity.write_jsonl(os.path.join(work, "prompts.jsonl"), n_prompts, seed)
    embedding = model.get_input_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embedding)
    return model_dir, prompts, sum(p.numel() for p in model.parameters()), matmul


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
            f"rollout.max_new_tokens={job['max_new_tokens']}", "rollout.temperature=1.0", "rollout.top_k=0",
            "rollout.top_p=1.0", f"actor.lr={job['lr']}", f"actor.mini_batch_size={job['prompts_per_step'] * job['n']}",
            f"actor.micro_batch_size={job['micro_batch']}", "actor.ppo_epochs=1", "actor.grad_clip=1.0",
            "actor.weight_decay=0.0", "algo.adv_estimator=grpo", "algo.kl_placement=loss", "algo.kl_kind=low_var_kl",
            f"algo.kl_coef={beta}", "algo.kl_ctrl=fixed", f"algo.use_kl_penalty={str(beta > 0).lower()}",
            "algo.clip_ratio_c=null", "algo.loss_agg_mode=token-mean", "algo.entropy_coef=0.0", "model.dtype=fp32",
            f"deepspeed.zero_stage={zero_stage}", f"trainer.total_steps={job['steps']}", f"trainer.seed={job['seed']}",
            f"trainer.output_dir={out}", "trainer.resume=none", "trainer.progress_bar=false", "trainer.plot=false",
            "trainer.export_hf=false", "trainer.val_every=0"]
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
        num_generations=job["n"], max_completion_length=job["max_new_tokens"], temperature=1.0, top_k=0, top_p=1.0,
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


def summarise(rows: list[dict], warmup: int, repeats: tuple = ()) -> dict:
    """s/step (median after warm-up), generated tokens/s over the measured steps, score of the first/last 10% (of
    ``rows``). ``repeats``: the rows of further runs of the same job, whose measured steps join the timing."""
    measured = [r for run in (rows, *repeats) for r in (run[warmup:] or run)]
    k = max(1, math.ceil(len(rows) / 10))
    out = {"step_s": statistics.median(r["step_s"] for r in measured),
           "cpu_s": statistics.median(r["cpu_s"] for r in measured),
           "tokens_per_s": sum(r["tokens"] for r in measured) / sum(r["step_s"] for r in measured),
           "cpu_tokens_per_s": sum(r["tokens"] for r in measured) / sum(r["cpu_s"] for r in measured),
           "score_first": statistics.fmean(r["score"] for r in rows[:k]),
           "score_last": statistics.fmean(r["score"] for r in rows[-k:])}
    if "gen" in rows[0]:  # the phases of one real step: the measured one whose time is nearest the median
        for clock, key in (("wall", "step_s"), ("cpu", "cpu_s")):
            typical = min(measured, key=lambda r: abs(r[key] - out[key]))
            pre = "cpu_" if clock == "cpu" else ""
            out[f"profile_{clock}"] = {"step_s": typical[key], **{p: typical[pre + p] for p in PHASES}}
    return out


def gemm_rate(m: int, k: int, n: int, threads: int, seconds: float = 1.0) -> float:
    """FLOP/s of a float32 (m, k) @ (k, n) matrix product (torch's, MKL in the x86 wheels) on ``threads`` threads:
    the best of several timed runs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        best = float("inf")
        for _ in range(3):
            torch.mm(a, b)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * m * k * n / best


def arithmetic_floor(rows: list[dict], warmup: int, samples: int, matmul_params: int, beta: float, rate: float,
                     n: int = 1, shared: bool = False) -> dict:
    """The seconds per step that the matrix products alone take at ``rate`` FLOP/s: forward 2 x params x tokens
    for the generation (prefill and decode of every sample), for the reference (when beta > 0) and in the update,
    whose backward adds 4 x params x tokens. Tokens per sample: the prompt and response lengths of verl_ds's
    measured steps; the generation feeds every token but the last sampled one. Unshared (TRL's arithmetic), the
    reference and the update feed every sample's whole prompt and response; with ``shared``
    (``model.share_prompts`` and ``rollout.share_prefill``) the generation's prefill, the reference and the update
    compute each prompt once for its ``n`` samples, and the scoring passes leave out each response's last token
    (it predicts nothing). Attention scores, norms and activations are left out (sequences of ~16 tokens), so no
    implementation doing that arithmetic can run faster. The response tokens that samples of a prompt have in
    common at their start (``model.share_response_prefixes``) are counted for every sample: verl_ds's scoring
    passes feed them once, so it can step below the shared floor."""
    measured = rows[warmup:] or rows
    prompt = statistics.fmean(r["prompt_len"] for r in measured)
    response = statistics.fmean(r["response_len"] for r in measured)
    every = samples * (prompt + response)
    prompts = samples / n * prompt if shared else samples * prompt
    generated = prompts + samples * max(response - 1, 0)
    scored = prompts + samples * max(response - 1, 0) if shared else every  # the reference and update passes
    passes = (2 if beta > 0 else 0) + 6
    flop = matmul_params * (2 * generated + passes * scored)
    return {"flop": flop, "tokens": every, "scored_tokens": scored, "floor_s": flop / rate}


def _revision() -> str:
    """The checkout's commit, '+changes' when verl_ds/ has uncommitted edits (the figures belong to that tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "verl_ds"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(no git)"
    return (head or "(no git)") + ("+changes" if dirty else "")


def _profile(name: str, prof: dict) -> str:
    step = prof["step_s"]
    phases = {p: prof[p] for p in PHASES if prof[p] > 0}
    other = step - sum(phases.values())
    parts = [f"{p} {v * 1000:.0f} ms ({100 * v / step:.0f}%)" for p, v in sorted(phases.items(), key=lambda kv: -kv[1])]
    return f"  {name}: step {step * 1000:.0f} ms = " + ", ".join(parts) + f", untimed {other * 1000:.0f} ms"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,30m", help="comma-separated, from " + ", ".join(SIZES))
    p.add_argument("--steps-tiny", type=int, default=40)
    p.add_argument("--steps-30m", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps dropped from the timing (not from the scores)")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (TRL num_generations)")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward (TRL per-device batch)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.01, help="KL coefficient (k3 in the loss; 0: no reference)")
    p.add_argument("--zero-stages", default="0,3", help="verl_ds ZeRO stages to run; the first is the headline")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side, interleaved; the timing pools their "
                   "measured steps (a shared machine's speed drifts by 2x from one hour to the next)")
    p.add_argument("--verl-ds-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                   help="an extra verl_ds row (at the first of --zero-stages) with these launch/train.py overrides, "
                        "e.g. 'unshared:model.share_prompts=false'; repeatable, not used in the ratios")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per side and size")
    p.add_argument("--work-dir", default=None, help="keep models, prompts and runs here (default: a temp dir)")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker:
        return trl_worker(a.trl_worker)
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    stages = [int(z) for z in a.zero_stages.split(",")]
    bad = [s for s in sizes if s not in SIZES] + [z for z in stages if z not in (0, 1, 2, 3)]
    if bad or not sizes or not stages:
        raise SystemExit(f"--sizes must name sizes from {sorted(SIZES)} and --zero-stages stages 0-3; got {bad or a}")
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1; got {a.repeats}")
    variants = []
    for v in a.verl_ds_variant:
        name, sep, overrides = v.partition(":")
        pairs = [o.strip() for o in overrides.split(",") if o.strip()]
        if not sep or not name.strip() or not pairs or not all("=" in o for o in pairs):
            raise SystemExit(f"--verl-ds-variant must be NAME:KEY=VALUE[,KEY=VALUE...]; got {v!r}")
        variants.append((name.strip(), tuple(pairs)))
    samples = a.prompts_per_step * a.n
    if a.micro_batch < 1 or samples % a.micro_batch:
        raise SystemExit(f"--micro-batch must divide prompts per step x n = {samples}; got {a.micro_batch}")
    try:
        import transformers
        import trl
    except ImportError as exc:
        raise SystemExit(f"e2e_vs_trl needs TRL ({exc}): pip install -c <(echo torch==$(python -c 'import torch; "
                         "print(torch.__version__)')) 'trl>=1.16'") from None
    work = a.work_dir or tempfile.mkdtemp(prefix="verl_ds_vs_trl_")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"e2e_vs_trl: GRPO, {a.prompts_per_step} prompts x n={a.n} per step, micro-batch {a.micro_batch}, "
          f"max_new_tokens {a.max_new_tokens}, lr {a.lr}, beta {a.beta}, 1 process, CPU, OMP_NUM_THREADS={a.threads}, "
          f"TRL {trl.__version__}, transformers {transformers.__version__}, verl_ds {_revision()}, "
          f"load average {load:.1f}, {a.repeats} run(s) of each side, work dir {work}")
    header = f"{'size':5s} {'side':16s} {'steps':>5s} {'s/step':>7s} {'cpu s/step':>10s} {'tok/s':>7s} " \
             f"{'tok/cpu-s':>9s} {'score first':>11s} {'score last':>10s} {'wall s':>7s}"
    print(header + "\n" + "-" * len(header), flush=True)
    results, ratios, floors = {}, {}, {}
    for size in sizes:
        steps = a.steps_tiny if size == "tiny" else a.steps_30m
        if steps <= a.warmup:
            raise SystemExit(f"--steps-{size} must exceed --warmup ({a.warmup}); got {steps}")
        size_dir = os.path.join(work, size)
        model_dir, prompts, n_params, matmul_params = prepare(size_dir, size, max(4096, steps * a.prompts_per_step),
                                                              a.seed)
        job = {"model_dir": model_dir, "prompts": prompts, "steps": steps, "prompts_per_step": a.prompts_per_step,
               "n": a.n, "micro_batch": a.micro_batch, "max_new_tokens": a.max_new_tokens, "lr": a.lr, "beta": a.beta,
               "seed": a.seed, "threads": a.threads}
        sides = [("trl", lambda: run_trl(job, os.path.join(size_dir, "trl"), a.timeout))]
        verl_rows = {}
        sides += [(f"verl_ds ZeRO-{z}", lambda z=z: run_verl_ds(job, z, os.path.join(size_dir, f"verl_ds_z{z}"),
                                                                 a.timeout)) for z in stages]
        sides += [(f"verl_ds {name}", lambda i=i, pairs=pairs: run_verl_ds(
            job, stages[0], os.path.join(size_dir, f"verl_ds_variant{i}"), a.timeout, pairs))
            for i, (name, pairs) in enumerate(variants)]
        runs = {side: [] for side, _ in sides}
        for _ in range(a.repeats - 1):  # the sides in turn, so that a slower hour weighs on each of them alike
            for side, fn in sides:
                runs[side].append(fn()[0])
        for side, fn in sides:
            rows, wall = fn()
            if side.startswith("verl_ds"):
                verl_rows[side] = rows
            s = results[size, side] = summarise(rows, a.warmup, tuple(runs[side]))
            print(f"{size:5s} {side:16s} {len(rows):5d} {s['step_s']:7.3f} {s['cpu_s']:10.3f} {s['tokens_per_s']:7.0f} "
                  f"{s['cpu_tokens_per_s']:9.0f} {s['score_first']:11.3f} {s['score_last']:10.3f} {wall:7.0f}",
                  flush=True)
        trl_s, ours = results[size, "trl"], results[size, f"verl_ds ZeRO-{stages[0]}"]
        key = "tiny" if size == "tiny" else "big"
        ratios[f"{key}_step_ratio"] = ours["step_s"] / trl_s["step_s"]
        ratios[f"{key}_tokens_per_s_ratio"] = ours["tokens_per_s"] / trl_s["tokens_per_s"]
        ratios[f"{key}_cpu_step_ratio"] = ours["cpu_s"] / trl_s["cpu_s"]
        ratios[f"{key}_cpu_tokens_per_s_ratio"] = ours["cpu_tokens_per_s"] / trl_s["cpu_tokens_per_s"]
        ratios[f"{key}_score_last_diff"] = ours["score_last"] - trl_s["score_last"]
        print(f"      ({size}: {n_params / 1e6:.2f}M parameters)", flush=True)
        cfg = SIZES[size]  # the update's products: a micro-batch's tokens x hidden x MLP width, the best-fed shape
        m_tokens = a.micro_batch * (a.max_new_tokens + 8)
        rate = max(gemm_rate(m_tokens, cfg["hidden_size"], cfg["intermediate_size"], a.threads),
                   gemm_rate(m_tokens, cfg["intermediate_size"], cfg["hidden_size"], a.threads))
        head = verl_rows[f"verl_ds ZeRO-{stages[0]}"]
        floor = floors[size] = arithmetic_floor(head, a.warmup, samples, matmul_params, a.beta, rate)
        floor["shared"] = arithmetic_floor(head, a.warmup, samples, matmul_params, a.beta, rate, a.n, shared=True)
        floor["rate"] = rate
        ratios[f"{key}_floor_step_ratio"] = floor["floor_s"] / trl_s["step_s"]
    print("\nverl_ds per-phase profile of one step (the measured step nearest the median), in wall and CPU seconds:")
    for (size, side), s in results.items():
        for clock in ("wall", "cpu"):
            if f"profile_{clock}" in s:
                print(_profile(f"{size} {side} {clock}", s[f"profile_{clock}"]))
    print("\nArithmetic floor: the matrix products alone at the measured float32 GEMM rate on "
          f"{a.threads} thread(s), computing every sample's prompt in every pass (as TRL does), and with each "
          "prompt once per group in the generation, reference and update passes (verl_ds's model.share_prompts and "
          "rollout.share_prefill), each response's last token left out of the scoring passes (shared response "
          "prefixes counted for every sample: verl_ds feeds them once, model.share_response_prefixes):")
    for size, f in floors.items():
        trl_s, ours = results[size, "trl"]["step_s"], results[size, f"verl_ds ZeRO-{stages[0]}"]["step_s"]
        sh = f["shared"]
        print(f"  {size}: {f['flop']:.3g} FLOP per step ({f['tokens']:.0f} tokens per pass) at {f['rate'] / 1e9:.1f} "
              f"GFLOP/s = {f['floor_s']:.3f} s/step, {f['floor_s'] / trl_s:.2f} x TRL's {trl_s:.3f} s "
              f"({100 * f['floor_s'] / trl_s:.0f}% of the rate); shared prompts: {sh['flop']:.3g} FLOP "
              f"({sh['scored_tokens']:.0f} tokens per pass) = {sh['floor_s']:.3f} s/step, "
              f"verl_ds ZeRO-{stages[0]} {ours:.3f} s ({100 * sh['floor_s'] / ours:.0f}% of the rate)")
    print(f"\nratios use verl_ds ZeRO-{stages[0]}; step ratio = verl_ds s/step / TRL s/step (< 1: verl_ds faster), "
          "tokens/s ratio = verl_ds / TRL (wall), cpu step ratio = the same in process CPU seconds (less sensitive to "
          "other load), score diff = verl_ds - TRL (last 10% of steps), floor step ratio = the unshared arithmetic floor / TRL s/step")
    print("e2e_vs_trl " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()) + f" load={load:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verl-ds-worker"]:  # before argparse: the rest are launch/train.py's arguments
        sys.exit(verl_ds_worker(sys.argv[2], sys.argv[3:]))
    main()
