"""End-to-end PPO throughput: the default job and a larger tiny model, gathered vs per-token generation; and
full fine-tuning vs LoRA (actor and critic adapters, no reference engine) on the larger model: step time and
the peak RSS of the training process.

Runs ``launch/train.py`` (ZeRO-3, world size 1 unless --nproc) for a few steps per case and reads the
per-step timings the trainer logs (``timing_s/*``). The first steps are warm-up and dropped. Peak RSS is
the largest VmHWM among the run's Python processes (each rank with --nproc > 1), and CPU s/run their user +
system CPU seconds (start-up included), both polled from /proc: CPU seconds change less than wall time on a
shared machine.

    python benchmarks/e2e.py               # ~5-8 min on 2 CPU cores
    python benchmarks/e2e.py --steps 6 --nproc 2
    python benchmarks/e2e.py --cases lora  # only full fine-tuning vs LoRA
    python benchmarks/e2e.py --cases engine --steps 4  # HF vs vLLM generation (needs the vLLM venv)

The engine cases run the 21M-parameter model (hidden 512, 8 layers, head_dim 64: vLLM's CPU attention refuses
the default head_dim 16) on 32 prompts x 4 samples x 64 new tokens (GRPO: no critic), once with HF ``generate``
and once with ``rollout.engine=vllm`` under the vLLM venv's interpreter (``--vllm-python``, default
$VERL_DS_VLLM_PYTHON or .venv-vllm/bin/python; ``bash scripts/install_vllm.sh`` makes it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "default job (h64 L2)": [],
    "larger tiny model (h256 L4)": ["model.config_overrides.hidden_size=256", "model.config_overrides.intermediate_size=768", "model.config_overrides.num_hidden_layers=4",
                                    "model.config_overrides.num_attention_heads=8", "model.config_overrides.num_key_value_heads=4"],
}
LORA_MODEL = "larger tiny model (h256 L4)"
LORA = {"full fine-tuning": [], "LoRA r=8 (actor + critic)": ["actor.lora_rank=8", "critic.lora_rank=8"]}
ENGINE_PROMPTS, ENGINE_N = 32, 4  # samples per step: ENGINE_PROMPTS * ENGINE_N
ENGINE_MODEL = ["model.config_overrides.hidden_size=512", "model.config_overrides.intermediate_size=1376", "model.config_overrides.num_hidden_layers=8", "model.config_overrides.num_attention_heads=8",
                "model.config_overrides.num_key_value_heads=4", f"rollout.batch_size={ENGINE_PROMPTS}", f"rollout.n={ENGINE_N}",
                "rollout.max_new_tokens=64", "algo.adv_estimator=grpo",
                f"actor.mini_batch_size={ENGINE_PROMPTS * ENGINE_N}", "actor.micro_batch_size=32"]
PHASES = {"gen": ["timing_s/gen"],
          "log-probs/values": ["timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv"],
          "update": ["timing_s/update_actor", "timing_s/update_critic"]}


class ProcessWatch:
    """Polls a process tree in /proc (Linux): each Python process's peak RSS (VmHWM) and CPU seconds
    (utime + stime). Compilers or other non-Python children (a JIT build) are not counted."""

    def __init__(self, pid: int, every_s: float = 0.25):
        self.pid, self.every_s = pid, every_s
        self.hwm_kib: dict = {}
        self.cpu_s: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list:
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as fh:
                        todo += [int(c) for c in fh.read().split()]
            except OSError:
                pass
        return pids

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/status") as fh:
                    status = dict(line.split(":", 1) for line in fh if ":" in line)
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if "python" not in status.get("Name", "") or "VmHWM" not in status:
                continue
            self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), int(status["VmHWM"].split()[0]))
            self.cpu_s[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"rss_mib": max(self.hwm_kib.values(), default=0) / 1024, "cpu_s": sum(self.cpu_s.values())}


def run_case(overrides: list, steps: int, nproc: int, threads: int, python: str = sys.executable
             ) -> tuple[list[dict], dict]:
    """(per-step metrics, {"rss_mib": the largest Python process's peak RSS, "cpu_s": their CPU seconds})."""
    out = tempfile.mkdtemp(prefix="verl_ds_bench_")
    args = [f"trainer.output_dir={out}", "trainer.resume=none", f"trainer.total_steps={steps}", "trainer.loggers=[]",
            "trainer.export=none", "trainer.val_every=0", *overrides]
    train = os.path.join(ROOT, "launch", "train.py")
    cmd = [python, train, *args] if nproc == 1 else \
        [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", train, *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning")
    if python != sys.executable:  # DeepSpeed's JIT-built CPU comm op is rebuilt when another venv built it last
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        watch = ProcessWatch(proc.pid)
        proc.wait()
        stats = watch.stop()
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"run failed ({' '.join(overrides)}):\n{log.read()[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return [m for m in map(json.loads, fh) if "timing_s/step" in m], stats


def summarise(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:] or rows
    med = lambda keys: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)  # noqa: E731
    step = med(["timing_s/step"])
    return {"step_s": step, "steps_per_s": 1.0 / step, "tokens_per_s": statistics.median(r["perf/throughput"] for r in rows),
            **{name: med(keys) for name, keys in PHASES.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--rounds", type=int, default=1, help="LoRA cases: rounds of (full, LoRA), medians reported")
    p.add_argument("--cases", choices=("all", "gen", "lora", "engine"), default="all",
                   help="gen: gathered vs per-token generation; lora: full fine-tuning vs LoRA; engine: HF vs vLLM "
                        "generation (not in 'all': it needs the vLLM venv)")
    p.add_argument("--vllm-python", default=os.environ.get("VERL_DS_VLLM_PYTHON") or
                   os.path.join(ROOT, ".venv-vllm", "bin", "python"), help="the vLLM venv's interpreter")
    args = p.parse_args()
    print(f"verl_ds e2e benchmark: ZeRO-3, {args.nproc} rank(s), OMP_NUM_THREADS={args.threads}, {args.steps} steps per case "
          f"(median over steps after {args.warmup} warm-up), CPU")
    header = f"{'case':44s} {'step s':>7s} {'steps/s':>8s} {'tok/s':>8s} {'gen s':>7s} {'lp/val s':>9s} {'update s':>9s}"
    if args.cases in ("all", "gen"):
        gen_cases(args, header)
    if args.cases in ("all", "lora"):
        lora_cases(args)
    if args.cases == "engine":
        engine_cases(args)


def gen_cases(args, header: str) -> None:
    print(header)
    print("-" * len(header))
    results = {}
    for name, overrides in CASES.items():
        for gather in (True, False):
            label = f"{name}, {'gathered' if gather else 'per-token'} gen"
            t0 = time.perf_counter()
            rows, _ = run_case([*overrides, f"rollout.gather_params={str(gather).lower()}"], args.steps, args.nproc,
                               args.threads)
            s = summarise(rows, args.warmup)
            results[label] = s
            print(f"{label:44s} {s['step_s']:7.3f} {s['steps_per_s']:8.2f} {s['tokens_per_s']:8.0f} {s['gen']:7.3f} "
                  f"{s['log-probs/values']:9.3f} {s['update']:9.3f}   ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    print()
    for name in CASES:
        g, t = results[f"{name}, gathered gen"], results[f"{name}, per-token gen"]
        print(f"{name}: generation with gathered parameters is {t['gen'] / g['gen']:.1f}x faster than per-token "
              f"gathering; the whole step {t['step_s'] / g['step_s']:.2f}x")



def lora_cases(args) -> None:
    """Full fine-tuning (actor, critic, a frozen reference) vs LoRA (adapters on actor and critic, the reference is
    the actor with adapters off) on the same model, both with gathered generation; ``--rounds`` alternates them."""
    print(f"\n{LORA_MODEL}: full fine-tuning vs LoRA, {args.rounds} round(s) alternating, medians")
    header = f"{'case':44s} {'step s':>7s} {'update s':>9s} {'lp/val s':>9s} {'CPU s/run':>10s} {'peak RSS MiB':>13s}"
    print(header)
    print("-" * len(header))
    runs = {name: [] for name in LORA}
    for _ in range(args.rounds):
        for name, overrides in LORA.items():
            t0 = time.perf_counter()
            rows, stats = run_case([*CASES[LORA_MODEL], *overrides], args.steps, args.nproc, args.threads)
            s = {**summarise(rows, args.warmup), **stats}
            runs[name].append(s)
            print(f"{name:44s} {s['step_s']:7.3f} {s['update']:9.3f} {s['log-probs/values']:9.3f} {s['cpu_s']:10.1f} "
                  f"{s['rss_mib']:13.0f}   ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    full, lo = med["full fine-tuning"], med["LoRA r=8 (actor + critic)"]
    print(f"LoRA vs full fine-tuning: step time x{lo['step_s'] / full['step_s']:.2f}, update x"
          f"{lo['update'] / full['update']:.2f}, CPU seconds per run x{lo['cpu_s'] / full['cpu_s']:.2f}, peak RSS x"
          f"{lo['rss_mib'] / full['rss_mib']:.2f} ({lo['rss_mib'] - full['rss_mib']:+.0f} MiB)")

def engine_cases(args) -> None:
    """Generation time per step, HF generate vs vLLM (in-process, weights synced after every update), same run."""
    if not os.path.exists(args.vllm_python):
        raise SystemExit(f"no vLLM interpreter at {args.vllm_python}: bash scripts/install_vllm.sh, or --vllm-python")
    print("\n21M-parameter model (h512 L8), 32 prompts x 4 samples x 64 new tokens, GRPO: generation per step")
    header = f"{'engine':44s} {'step s':>7s} {'gen s':>7s} {'sync s':>7s} {'gen tok/s':>10s} {'|lp diff|':>10s}"
    print(header)
    print("-" * len(header))
    res = {}
    for engine, python in (("hf", sys.executable), ("vllm", args.vllm_python)):
        t0 = time.perf_counter()
        rows, _ = run_case([*ENGINE_MODEL, f"rollout.engine={engine}"], args.steps, args.nproc, args.threads, python)
        s = summarise(rows, args.warmup)
        kept = rows[args.warmup:] or rows
        s["sync"] = statistics.median(r.get("timing_s/weight_sync", 0.0) for r in kept)
        samples = ENGINE_PROMPTS * ENGINE_N
        s["gen_tok_s"] = statistics.median(r.get("response_length/mean", 0.0) * samples / r["timing_s/gen"] for r in kept)
        diff = [r["rollout/log_prob_diff_mean"] for r in kept if "rollout/log_prob_diff_mean" in r]
        res[engine] = s
        print(f"{engine:44s} {s['step_s']:7.3f} {s['gen']:7.3f} {s['sync']:7.3f} {s['gen_tok_s']:10.0f} "
              f"{(f'{statistics.mean(diff):.1e}' if diff else '-'):>10s}   ({time.perf_counter() - t0:.0f} s wall)",
              flush=True)
    print(f"vLLM vs HF generate: generation per step x{res['vllm']['gen'] / res['hf']['gen']:.2f} "
          f"({res['hf']['gen'] / res['vllm']['gen']:.2f}x faster), "
          f"whole step x{res['vllm']['step_s'] / res['hf']['step_s']:.2f}")


if __name__ == "__main__":
    main()
