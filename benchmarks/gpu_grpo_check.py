"""A short GRPO job on a ~0.5B Qwen2-shaped model built from config (no download), once with the per-sequence
attention loop and once with ``model.attn_implementation=auto``, through ``launch/train.py``.

The job: Qwen2 with hidden 896, MLP 4864, 24 layers, 14 heads (2 KV heads) as Qwen2.5-0.5B, a 32,000-token
word-level tokenizer (``verl_ds.tokenizer``, saved once; a fresh model then almost never samples EOS, so responses
run to ``rollout.max_new_tokens``), parity prompts with 180-240 context digits (~240 tokens), 8 prompts x n=8 per
step, 256 new tokens, packed rows with shared prompts (``model.remove_padding``, ``model.share_prompts``), GRPO with
the k3 KL in the loss, bf16, one optimizer step per step, ``trainer.total_steps`` 3. Each run is its own process
(``launch/train.py`` run by this script's ``--worker``, which also records the peak CUDA memory and skips the final
checkpoint: gigabytes of optimizer state that this check does not measure).

Per run it prints the step time (the mean of the steps after the first, which pays for compilation and warm-up),
its generation / reference / update phases, response tokens per second (``perf/total_num_tokens`` over the step
time) and the peak memory, then a last line

    gpu_check attention_step_ratio=<auto s/step / loop s/step> tokens_per_s=<auto's> peak_mem_gib=<auto's>

``model.attn_implementation`` must be a config key of this tree (issue 32's attention path) and both names must be
accepted by it; otherwise the script exits 2 saying which, before starting anything.

    python benchmarks/gpu_grpo_check.py --out runs/gpu_check              # CUDA
    python benchmarks/gpu_grpo_check.py --device cpu --tiny --out /tmp/g  # the CPU smoke size
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # verl_ds from this checkout

LOOP = "sdpa"  # packed rows then run one sdpa call per sequence or prompt group per layer (attention_layout.packed_attention)
SHAPES = {  # model.* keys; prompts: context digits of the parity prompts; job: per step
    "0.5b": {"model": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                           max_position_embeddings=1024),
             "vocab": 32000, "context": (180, 240), "max_prompt_length": 256, "prompts": 8, "n": 8,
             "max_new_tokens": 256, "micro_batch": 16},
    "tiny": {"model": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           max_position_embeddings=128),
             "vocab": 512, "context": (4, 8), "max_prompt_length": 16, "prompts": 2, "n": 2, "max_new_tokens": 12,
             "micro_batch": 2},
}
PHASES = ("gen", "ref", "update_actor")

# the shapes above by their HF config field names (model.config_overrides)
HF_FIELD = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


def config_problem(impls: list[str]) -> str | None:
    """Why this tree's config refuses ``model.attn_implementation`` with one of ``impls``, or None."""
    from verl_ds.config import load_config
    from verl_ds.config.fields import ConfigError

    for impl in impls:
        try:
            load_config(overrides=[f"model.attn_implementation={impl}"])
        except ConfigError as exc:
            if "unknown config key 'model.attn_implementation'" in str(exc):
                return ("model.attn_implementation is not a config key of this verl_ds tree (issue 32's attention "
                        "path has not landed here), so the attention cannot be chosen")
            return f"model.attn_implementation={impl} is refused: {exc}"
    return None


def prepare(work: str, shape: dict, seed: int = 0) -> tuple[str, str]:
    """(tokenizer directory, prompt file) for the job."""
    from verl_ds.tasks import parity
    from verl_ds.tokenizer import build_tokenizer, default_vocab

    words = list(default_vocab())
    known = set(words)
    letters = "abcdefghijklmnopqrstuvwxyz"  # made-up words of letters only (a digit would be split off)
    made_up = ("t" + "".join(letters[i // 26**k % 26] for k in range(4)) for i in range(shape["vocab"]))
    words += [w for w in made_up if w not in known]
    tok_dir = os.path.join(work, "tokenizer")
    build_tokenizer(words[:shape["vocab"] - 4], model_max_length=4096).save_pretrained(tok_dir)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w", encoding="utf-8") as fh:
        for record in parity.generate_prompts(256, seed, context_len=shape["context"]):
            fh.write(json.dumps(record) + "\n")
    return tok_dir, prompts


def job_args(shape: dict, device: str, tok_dir: str, prompts: str, out: str, impl: str, steps: int) -> list[str]:
    """launch/train.py overrides of one run."""
    samples = shape["prompts"] * shape["n"]
    return (["model.arch=qwen2"] + [f"model.config_overrides.{HF_FIELD.get(k, k)}={v}" for k, v in shape["model"].items()] + [
        f"model.tokenizer_path={tok_dir}", f"data.train_files={prompts}",
        f"data.max_prompt_length={shape['max_prompt_length']}", f"rollout.batch_size={shape['prompts']}",
        f"rollout.n={shape['n']}", f"rollout.max_new_tokens={shape['max_new_tokens']}",
        f"actor.mini_batch_size={samples}", f"actor.micro_batch_size={shape['micro_batch']}", "actor.lr=1e-6",
        "algo.adv_estimator=grpo", "algo.kl_placement=loss", "algo.kl_kind=low_var_kl", "algo.kl_coef=0.001",
        "algo.kl_ctrl=fixed", "model.remove_padding=true", "model.share_prompts=true",
        f"model.dtype={'bf16' if device == 'cuda' else 'fp32'}", f"trainer.device={device}",
        f"model.attn_implementation={impl}", f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
        "trainer.resume=none", "trainer.loggers=[]", "trainer.export=none",
        "trainer.val_every=0"])


def worker(result: str, args: list[str]) -> int:
    """``launch/train.py args`` in this interpreter, then the peak memory (CUDA allocator, else the process's
    resident set) written to ``result``; the final checkpoint is skipped."""
    import resource

    import torch

    from verl_ds.trainer import Trainer

    Trainer.save_checkpoint = lambda trainer: None  # no multi-GiB write at the end
    sys.argv = [os.path.join(ROOT, "launch", "train.py"), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
        peak = {"peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "memory": "CUDA allocator"}
    else:
        peak = {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "memory": "max RSS"}
    with open(result, "w", encoding="utf-8") as fh:
        json.dump({"rc": rc, **peak}, fh)
    return rc


def _tail(path: str, chars: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()[-chars:]


def _logged_steps(out: str) -> str:
    """Each logged step's time and phases, for a run that did not finish."""
    try:
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
            rows = [m for m in map(json.loads, fh) if "timing_s/step" in m]
    except OSError:
        return "none"
    return "; ".join(f"{r['timing_s/step']:.2f} s (" + ", ".join(f"{p} {r.get(f'timing_s/{p}', 0.0):.2f}"
                                                                   for p in PHASES) + ")" for r in rows) or "none"


def run_one(impl: str, a, shape: dict, tok_dir: str, prompts: str, work: str) -> dict:
    """One run in its own process; its per-step rows and peak memory."""
    out = os.path.join(work, f"run_{impl}")
    shutil.rmtree(out, ignore_errors=True)
    result = os.path.join(work, f"result_{impl}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", result, "--",
           *job_args(shape, a.device, tok_dir, prompts, out, impl, a.steps), *a.set]
    env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if a.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    log_path = os.path.join(work, f"log_{impl}.txt")
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log_fh:  # a file, not a pipe: what a killed run printed is kept
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log_fh, stderr=subprocess.STDOUT,
                                timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"none: stopped after {a.timeout:.0f} s (--timeout)"
    wall = time.perf_counter() - t0
    if rc != 0 or not os.path.exists(result):
        raise SystemExit(f"gpu_grpo_check: the {impl} run failed (exit {rc}); steps logged: "
                         f"{_logged_steps(out)}; its output ends:\n{_tail(log_path, 5000)}")
    with open(result, encoding="utf-8") as fh:
        res = json.load(fh)
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [m for m in map(json.loads, fh) if "timing_s/step" in m]
    if len(rows) != a.steps:
        raise SystemExit(f"gpu_grpo_check: the {impl} run logged {len(rows)} steps, expected {a.steps}")
    measured = rows[1:] or rows
    step = statistics.fmean(r["timing_s/step"] for r in measured)
    res.update(impl=impl, wall_s=wall, step_s=step, steps=[r["timing_s/step"] for r in rows],
               tokens_per_s=sum(r["perf/total_num_tokens"] for r in measured) / sum(r["timing_s/step"]
                                                                                    for r in measured),
               **{p: statistics.fmean(r.get(f"timing_s/{p}", 0.0) for r in measured) for p in PHASES})
    shutil.rmtree(out, ignore_errors=True)
    return res


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:  # launch/train.py's arguments follow the "--"
        rest = sys.argv[3:]
        return worker(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, a few tokens (the CPU smoke size)")
    p.add_argument("--loop", default=LOOP, help="the model.attn_implementation of the per-sequence loop (baseline)")
    p.add_argument("--impl", default="auto", help="the model.attn_implementation compared with the loop")
    p.add_argument("--steps", type=int, default=3, help="trainer.total_steps of each run (the first is not timed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more launch/train.py override for both runs (repeatable)")
    p.add_argument("--only", choices=("loop", "impl"), default=None,
                   help="run one side only (its figures, no ratio): e.g. the other side's time ran out")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", default=None, help="write grpo_check.json here (a directory)")
    a = p.parse_args(argv)
    if a.steps < 2:
        print(f"gpu_grpo_check: --steps must be >= 2 (the first is not timed); got {a.steps}", file=sys.stderr)
        return 2
    problem = config_problem([a.loop, a.impl])
    if problem:
        print(f"gpu_grpo_check: {problem}; nothing was run", file=sys.stderr)
        return 2
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_grpo_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    shape = SHAPES["tiny" if a.tiny else "0.5b"]
    work = tempfile.mkdtemp(prefix="verl_ds_grpo_check_")
    try:
        tok_dir, prompts = prepare(work, shape)
        m = shape["model"]
        print(f"gpu_grpo_check: Qwen2 hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads "
              f"({m['num_kv_heads']} KV), vocab {shape['vocab']}; {shape['prompts']} prompts x n={shape['n']}, "
              f"~{sum(shape['context']) // 2 + 3}-token prompts, {shape['max_new_tokens']} new tokens, "
              f"{a.steps} steps, {a.device}", flush=True)
        runs = {}
        for impl in (a.loop, a.impl) if a.only is None else ((a.loop, a.impl)[a.only == "impl"],):
            r = runs[impl] = run_one(impl, a, shape, tok_dir, prompts, work)
            print(f"  {impl:20s} {r['step_s']:7.2f} s/step (gen {r['gen']:.2f}, ref {r['ref']:.2f}, update "
                  f"{r['update_actor']:.2f}; steps {', '.join(f'{s:.2f}' for s in r['steps'])}), "
                  f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_gib']:.2f} GiB ({r['memory']}), process "
                  f"{r['wall_s']:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.only is not None:
        print(f"gpu_grpo_check: --only {a.only}: no ratio")
        return 0
    loop, new = runs[a.loop], runs[a.impl]
    figures = {"attention_step_ratio": new["step_s"] / loop["step_s"],
               "scoring_ratio": (new["ref"] + new["update_actor"]) / max(loop["ref"] + loop["update_actor"], 1e-9),
               "tokens_per_s": new["tokens_per_s"], "peak_mem_gib": new["peak_gib"]}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "grpo_check.json"), "w", encoding="utf-8") as fh:
            json.dump({"runs": runs, **figures}, fh, indent=1)
    print(f"  {a.impl} / {a.loop}: step {figures['attention_step_ratio']:.3f}, reference + update "
          f"{figures['scoring_ratio']:.3f}")
    print(f"gpu_check attention_step_ratio={figures['attention_step_ratio']:.3f} "
          f"tokens_per_s={figures['tokens_per_s']:.0f} peak_mem_gib={figures['peak_mem_gib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
