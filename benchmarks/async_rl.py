"""Asynchronous RL (rollout.mode, docs/async.md): the same GRPO job on 2 CPU ranks, synchronous colocated vs
one-step-off vs streaming, colocated and on split ranks, timed in the same run.

The job: the built-in parity task, 16 prompts x n=4 per step, responses of up to ``--max-new-tokens`` (64) tokens
from a fresh tiny model over the task's 18-token vocabulary: each token is EOS with probability ~1/18, so response
lengths are geometric, heavy-tailed against the limit (most short, a few cut at the limit; the script prints the
measured distribution). In the synchronous mode every step waits for its slowest response, then trains. The
asynchronous modes (all with the decoupled off-policy correction): colocated one-step-off and streaming S=2 (a
generation thread on each rank's replica samples the next batches while the rank trains), and on split ranks
(``rollout.split_ranks=1``: rank 1 only generates the whole batch, rank 0 trains it alone) one-step-off and
streaming with ``max_staleness`` 1 and 2. Split streaming S=2 is the issue's "streaming on split ranks": the final
line's ``streaming_speedup``.

Per mode it prints generated tokens per second over the measured steps (after ``--warmup``, the fastest of
``--repeats`` runs) and its ratio to the synchronous run's (fastest over fastest, and per repeat: the runs of one
repeat see similar load from the machine's other jobs), the median step, each rank's busy share of the step
(colocated: the training and the generation (thread) of every rank; split: the training rank's step minus its
wait for samples, and the generation rank's ``async/gen_busy_s``), the mean staleness and the final score (mean
``rollout/score/mean`` of the last 5 steps); then the per-phase profiles of sync and split streaming and the 8-GPU
projections from them, the ratios, and last the line
``async_rl streaming_speedup=<x> one_step_off_speedup=<y> score_last_diff=<z>`` (split streaming's final
score minus the synchronous one).

    python benchmarks/async_rl.py                     # ~4-6 min on 2 loaded CPU cores (2 runs per mode)
    python benchmarks/async_rl.py --only split_streaming_S1,split_streaming_S2   # sync and these
    python benchmarks/async_rl.py --learning          # + the default task, sync vs streaming S=1, 2, seeds 0-2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
MODES = {"sync": [], "one_step_off": ["rollout.mode=one_step_off"],
         # colocated: a generation thread beside the training on each rank
         "colo_streaming_S2": ["rollout.mode=streaming", "rollout.max_staleness=2"],
         # split: rank 1 only generates, rank 0 trains the whole batch alone
         "split_one_step_off": ["rollout.mode=one_step_off", "rollout.split_ranks=1"],
         "split_streaming_S1": ["rollout.mode=streaming", "rollout.max_staleness=1", "rollout.split_ranks=1"],
         "split_streaming_S2": ["rollout.mode=streaming", "rollout.max_staleness=2", "rollout.split_ranks=1"]}
HEADLINE = "split_streaming_S2"  # the "streaming on split ranks": the final line's streaming_speedup
OFF_POLICY = ["rollout.is_correction=true", "rollout.is_mode=decoupled"]


def run(out: str, overrides: list, nproc: int = 2) -> list:
    """launch/train.py on ``nproc`` ranks (torchrun); returns the metrics rows of the trained steps."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONWARNINGS": "ignore"})
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                 f"--nproc_per_node={nproc}", f"--master_port={port}"]
    cmd = [*head, TRAIN, f"trainer.output_dir={out}", "trainer.loggers=[]",
           "trainer.export=none", "trainer.resume=none", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip() and "training/global_step" in line]


def figures(rows: list, warmup: int) -> dict:
    """Tokens/s, step time, busy shares, staleness, score and phases of one run's metrics rows (rank 0's: a
    training rank). ``trainer_busy``: the training rank's share of the step not spent waiting for samples (sync: not
    generating); ``gen_busy``: the generator's generate time over the step (sync: the same rank's generation; split:
    the generation rank's ``async/gen_busy_s``)."""
    m = rows[warmup:]
    step = sum(r["timing_s/step"] for r in m)
    tokens = sum(r["perf/total_num_tokens"] for r in m)
    wait = sum(r.get("timing_s/gen_wait", 0.0) for r in m)
    gen = sum(r.get("async/gen_busy_s", r.get("timing_s/gen", 0.0) + r.get("timing_s/reward", 0.0)) for r in m)
    return {"tokens_per_s": tokens / step, "step_s": statistics.median(r["timing_s/step"] for r in m),
            "trainer_busy": 1 - wait / step if "timing_s/gen_wait" in m[0] else
            1 - sum(r.get("timing_s/gen", 0) + r.get("timing_s/reward", 0) for r in m) / step,
            "gen_busy": gen / step, "staleness": statistics.mean(_staleness(r) for r in m),
            "score_last": statistics.mean(r["rollout/score/mean"] for r in rows[-5:]),
            "len_mean": statistics.mean(r["response_length/mean"] for r in m),
            "clip_ratio": statistics.mean(r["response_length/clip_ratio"] for r in m),
            "gen_s": statistics.mean(r.get("async/gen_busy_s", 0.0) for r in m),  # a batch counts at its end
            "phases": {k[len("timing_s/"):]: statistics.median(r.get(k, 0.0) for r in m) for k in m[0]
                       if k.startswith("timing_s/") and k != "timing_s/step"}}


def _staleness(row: dict) -> float:
    """Updates between the weights that sampled a step's batch and the trainer's: the queue's metric (colocated
    modes, split streaming); split one-step-off's: its batch was generated during step ``async/generated_at_step``
    with that step's weights (version step - 1), trained at step k with version k - 1."""
    if "async/staleness/mean" in row:
        return row["async/staleness/mean"]
    if "async/generated_at_step" in row:
        return row["training/global_step"] - row["async/generated_at_step"]
    return 0.0


def project(sync: dict, max_new: int, split: dict = None) -> str:
    """8 GPUs from the measured synchronous phases, generation G (gen + reward) and training T (the rest), each
    assumed to scale linearly with the GPUs it gets. A lock-step batch decodes for as many steps as its longest
    response; a streaming generator with partial rollouts keeps its batch full, ~``tail`` = mean / limit of that.
    With ``split`` (a split streaming run's figures): the same from its measured whole-batch phases, the generation
    rank's Gs (``async/gen_busy_s``) and the training rank's Ts (its phases but the wait for samples and the
    weight sync)."""
    p = sync["phases"]
    G = p.get("gen", 0.0) + p.get("reward", 0.0)
    T = sum(v for k, v in p.items() if k not in ("gen", "reward", "boundary"))
    tail = sync["len_mean"] / max_new
    lines = [f"measured per step (sync, median): generation G={G:.3f}s, training T={T:.3f}s "
             f"(G share {G / (G + T):.0%}); mean response length {sync['len_mean']:.1f} of {max_new} "
             f"(clipped {sync['clip_ratio']:.0%}): tail factor {tail:.2f}"]
    colocated = (G + T) / max(G, T)
    best = min(range(1, 8), key=lambda g: max(8 / g * G * tail, 8 / (8 - g) * T))
    ratio = (G + T) / max(8 / best * G * tail, 8 / (8 - best) * T)
    lines.append(f"8 GPUs: colocated one_step_off/streaming, generation overlapping training on the same GPUs: at most "
                 f"(G+T)/max(G,T) = {colocated:.2f}x; split streaming, {best} generate + {8 - best} train: "
                 f"(G+T)/max(8/{best}*G*{tail:.2f}, 8/{8 - best}*T) = {ratio:.2f}x (weight sync not counted)")
    if split is not None:
        sp = split["phases"]
        Gs, W = split["gen_s"], sp.get("weight_sync", 0.0)
        Ts = sum(v for k, v in sp.items() if k not in ("gen_wait", "weight_sync", "boundary"))
        on2 = (G + T) / max(Gs, Ts + W)
        best = min(range(1, 8), key=lambda g: max(Gs / g, Ts / (8 - g)))
        ratio = 2 * (G + T) / 8 / max(Gs / best, Ts / (8 - best))
        lines.append(f"measured per step (split streaming, the whole batch on one rank each; Gs mean, the rest "
                     f"median): generation rank Gs={Gs:.3f}s ({Gs / (2 * G):.2f} x 2G), training rank "
                     f"Ts={Ts:.3f}s ({Ts / (2 * T):.2f} x 2T) + weight sync W={W:.3f}s: on 2 ranks at most "
                     f"(G+T)/max(Gs, Ts+W) = {on2:.2f}x; 8 GPUs, "
                     f"{best} generate + {8 - best} train: 2(G+T)/8 / max(Gs/{best}, Ts/{8 - best}) = {ratio:.2f}x "
                     f"(weight sync not counted)")
    return "\n".join(lines)


def paired(reps: dict, mode: str) -> list:
    """Tokens/s of ``mode`` over sync's in the same repeat (runs minutes apart see similar load from other jobs)."""
    return [f["tokens_per_s"] / s["tokens_per_s"] for f, s in zip(reps[mode], reps["sync"])]


def busy(mode: str, f: dict) -> str:
    """Each rank's busy share of the step, in words."""
    if mode.startswith("split"):
        return f"busy: rank 0 (trains) {f['trainer_busy']:4.0%}, rank 1 (generates) {f['gen_busy']:4.0%}"
    thread = "" if mode == "sync" else " thread"
    return f"busy: each rank training {f['trainer_busy']:4.0%} + generation{thread} {f['gen_busy']:4.0%}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--only", default=",".join(MODES), help=f"which of {', '.join(MODES)} to time (sync always)")
    ap.add_argument("--learning", action="store_true", help="also the default task: sync vs streaming S=1, 2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="sync,S1,S2", help="--learning: which of sync, S1, S2")
    ap.add_argument("--learning-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved; the fastest is kept (the "
                                                             "machine's other load moves single runs)")
    args = ap.parse_args(argv)
    only = ["sync", *(m for m in args.only.split(",") if m != "sync")]
    unknown = [m for m in only if m not in MODES]
    if unknown:
        ap.error(f"--only: unknown mode(s) {', '.join(unknown)}; expected some of {', '.join(MODES)}")
    job = ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=16", "actor.mini_batch_size=64",
           "actor.micro_batch_size=16", f"rollout.max_new_tokens={args.max_new_tokens}",
           f"trainer.total_steps={args.steps}", "model.config_overrides.max_position_embeddings=128",
           "trainer.val_every=0"]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; 2 ranks, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '1')}", flush=True)
    res, walls = {}, {}
    if args.learning_only:
        with tempfile.TemporaryDirectory() as tmp:
            return learning(tmp, [int(s) for s in args.seeds.split(",")], args.modes.split(","))
    reps = {m: [] for m in only}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            # every other repeat in reverse: each mode runs as often just after sync as long after it
            for mode in (only if rep % 2 == 0 else only[::-1]):
                extra = MODES[mode]
                t0 = time.perf_counter()
                rows = run(os.path.join(tmp, f"{mode}{rep}"), [*job, *extra, *(OFF_POLICY if extra else [])])
                f = figures(rows, args.warmup)
                walls.setdefault(mode, []).append(time.perf_counter() - t0)
                reps[mode].append(f)
                if mode not in res or f["tokens_per_s"] > res[mode]["tokens_per_s"]:
                    res[mode] = f
        base = res["sync"]["tokens_per_s"]
        for mode in only:
            f = res[mode]
            pairs = "/".join(f"{r:.2f}" for r in paired(reps, mode))
            print(f"{mode:18s} tokens/s {f['tokens_per_s']:8.1f} ({f['tokens_per_s'] / base:.2f}x; per repeat "
                  f"{pairs})  step {f['step_s']:.3f}s  {busy(mode, f)}  staleness {f['staleness']:.2f}  score_last "
                  f"{f['score_last']:.3f}  length {f['len_mean']:.1f} (clipped {f['clip_ratio']:.0%})")
        for mode in ("sync", HEADLINE):
            if mode in res:
                print(f"{mode} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                              sorted(res[mode]["phases"].items())))
        print(project(res["sync"], args.max_new_tokens, res.get(HEADLINE)))
        print("wall per run (launch to exit, s): " + ", ".join(f"{m} " + "/".join(f"{w:.0f}" for w in ws)
                                                                for m, ws in walls.items()) +
              f"; load average now {os.getloadavg()[0]:.2f}")
        if args.learning:
            learning(tmp, [int(s) for s in args.seeds.split(",")], args.modes.split(","))
    print(" ".join(f"{mode}_speedup={f['tokens_per_s'] / base:.2f}" for mode, f in res.items() if mode != "sync"))
    if HEADLINE in res and "one_step_off" in res:
        print(f"async_rl streaming_speedup={res[HEADLINE]['tokens_per_s'] / base:.2f} "
              f"one_step_off_speedup={res['one_step_off']['tokens_per_s'] / base:.2f} "
              f"score_last_diff={res[HEADLINE]['score_last'] - res['sync']['score_last']:+.3f}")


def learning(tmp: str, seeds: list, modes: list) -> None:
    """The default task (150 steps, one rank each): the final greedy validation score per mode and seed."""
    for name, extra in (("sync", []), ("S1", ["rollout.mode=streaming", "rollout.max_staleness=1"]),
                        ("S2", ["rollout.mode=streaming", "rollout.max_staleness=2"])):
        if name not in modes:
            continue
        scores = []
        for seed in seeds:
            out = os.path.join(tmp, f"learn_{name.replace(' ', '_')}_{seed}")
            run(out, [f"trainer.seed={seed}", *extra, *(OFF_POLICY if extra else [])], nproc=1)
            with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
                s = json.load(fh)
            scores.append((s["val_after"], s["reward_last10"]))
        print(f"learning {name:14s} greedy val after: " + " ".join(f"seed{sd}={v:.3f}" for sd, (v, _) in
                                                                   zip(seeds, scores)) +
              f"  mean {statistics.mean(v for v, _ in scores):.3f}; train score last 10%: mean "
              f"{statistics.mean(r for _, r in scores):.3f}")


if __name__ == "__main__":
    main()
