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

Regimes (``--regime``, comma-separated; each runs every size of ``--sizes``):
- ``default``: 32 prompts x n=4, responses of at most 8 tokens over the task's 18-token vocabulary. The samples of a
  prompt often agree on their first tokens, which verl_ds computes once (shared prompts, prefill, response prefixes
  and decoding steps); TRL computes every sample's every token.
- ``long_diverse``: 8 prompts x n=4, responses of up to 256 tokens drawn at temperature 1 from a fresh model over a
  2,048-word vocabulary (the task's words plus made-up ones; the model's context 512): near-uniform sampling, so the
  samples of a prompt share nothing beyond the prompt (the share of response tokens in common prefixes, measured at
  the initial weights, is printed) and the prompt (~10 tokens) is a small part of each sequence. Both sides score
  in micro-batches of the same size (verl_ds ``rollout.log_prob_micro_batch_size`` = TRL's per-device batch).
  Scores stay near 0 (a digit among 2,048 words): the regime measures throughput, not learning.

    python benchmarks/e2e_vs_trl.py                          # both sizes: ~10-20 min on 2 loaded CPU cores
    python benchmarks/e2e_vs_trl.py --sizes tiny --steps-tiny 20
    python benchmarks/e2e_vs_trl.py --regime long_diverse --sizes 30m --zero-stages 0

Per side it prints seconds per step (median after warm-up), generated (response) tokens per second over the
measured steps, and the mean score of the first and last 10% of steps; then verl_ds's per-phase profile of one
step (median of ``timing_s/<phase>`` from metrics.jsonl) and one ``e2e_vs_trl ...`` line of ratios (keys of the
long_diverse regime start with ``long_``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # verl_ds from this checkout, installed or not

# the shapes above by their HF config field names (model.config_overrides)
HF_FIELD = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


def _sibling(name: str):
    """benchmarks/<name>.py as the module ``name``, by its path (a test loads this script without benchmarks/ on
    sys.path)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_sides = _sibling("e2e_vs_trl_sides")  # first: the figures' module reads its PHASES
_figures = _sibling("e2e_vs_trl_figures")
ENV, PHASES, run_trl, run_verl_ds = _sides.ENV, _sides.PHASES, _sides.run_trl, _sides.run_verl_ds
trl_worker, verl_ds_worker = _sides.trl_worker, _sides.verl_ds_worker
summarise, gemm_rate, arithmetic_floor, _profile = (_figures.summarise, _figures.gemm_rate, _figures.arithmetic_floor,
                                                    _figures._profile)

# model.* shapes; "30m": hidden 512, 8 layers, MLP 2048, 8 heads (4 KV): about 31M parameters
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "30m": {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
}
# each regime's job (the command line's values replace these); vocab: None for the task's 18 tokens, else the words
# of the tokenizer; context: the model's max_position_embeddings; prefix: of its keys in the last line
REGIMES = {
    "default": {"prompts_per_step": 32, "n": 4, "micro_batch": 16, "max_new_tokens": 8, "steps_tiny": 40,
                "steps_30m": 6, "vocab": None, "context": 256, "same_log_prob_chunks": False, "prefix": "",
                "label": ""},
    "long_diverse": {"prompts_per_step": 8, "n": 4, "micro_batch": 8, "max_new_tokens": 256, "steps_tiny": 5,
                     "steps_30m": 4, "vocab": 2048, "context": 512, "same_log_prob_chunks": True, "prefix": "long_",
                     "label": ":long"},
}


def wide_vocab(words: int) -> list[str]:
    """``words`` words (special tokens excluded): verl_ds's built-in vocabulary (the task's words among them), then
    made-up lower-case ones ('qa', 'qb', ... never a real word of it)."""
    from verl_ds.tokenizer import default_vocab

    vocab, i = list(default_vocab()), 0
    known = set(vocab)
    while len(vocab) < words:
        word, k = "q", i
        while True:
            word, k = word + "abcdefghijklmnopqrstuvwxyz"[k % 26], k // 26
            if not k:
                break
        if word not in known:
            vocab.append(word)
        i += 1
    return vocab[:words]


def prepare(work: str, size: str, n_prompts: int, seed: int, regime: str = "default") -> tuple[str, str, int, int]:
    """Save the size's tiny Llama (verl_ds's own construction and init) with its tokenizer (the regime's vocabulary),
    and the prompt file; returns (model_dir, prompts_file, number of parameters, parameters in matrix products: every
    2-D weight but the input embedding, a lookup)."""
    os.environ.update(ENV)  # quiet HF progress bars and DeepSpeed's accelerator warning here too
    from verl_ds.config import load_config
    from verl_ds.engines.build import build_actor_model, load_tokenizer
    from verl_ds.tasks import parity
    from verl_ds.tokenizer import build_tokenizer

    spec = REGIMES[regime]
    cfg = load_config(overrides=[f"model.config_overrides.{HF_FIELD.get(k, k)}={v}" for k, v in SIZES[size].items()]
                      + [f"model.config_overrides.max_position_embeddings={spec['context']}"])
    # the built-in task's vocabulary (parity.VOCAB), as the default job uses, or the regime's wide one
    tok = load_tokenizer(cfg) if spec["vocab"] is None else build_tokenizer(wide_vocab(spec["vocab"] - 4))
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


def shared_prefix_share(model_dir: str, prompts: str, n: int, max_new_tokens: int, groups: int = 4,
                        seed: int = 0) -> tuple[float, float]:
    """(share of the response tokens that lie in a prefix the sample has in common with another sample of its prompt,
    mean response length) of ``n`` samples for each of the first ``groups`` prompts, drawn at temperature 1 from the
    saved model (HF generate, EOS included): how much verl_ds's shared response prefixes could save."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with open(prompts, encoding="utf-8") as fh:
        texts = [json.loads(line)["prompt"] for _, line in zip(range(groups), fh)]
    shared = total = 0
    torch.manual_seed(seed)
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids.repeat(n, 1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        responses = []
        for row in out[:, ids.shape[1]:].tolist():
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            responses.append(row[:end])
        for i, r in enumerate(responses):
            common = 0
            for j, other in enumerate(responses):
                if j != i:
                    k = 0
                    while k < min(len(r), len(other)) and r[k] == other[k]:
                        k += 1
                    common = max(common, k)
            shared, total = shared + common, total + len(r)
    return shared / max(total, 1), total / (len(texts) * n)


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


_JOB_KEYS = ("prompts_per_step", "n", "micro_batch", "max_new_tokens", "steps_tiny", "steps_30m")


def _spec(a, regime: str) -> dict:
    """The regime's job with the command line's values (those given) in place of its own."""
    return {**REGIMES[regime], **{k: getattr(a, k) for k in _JOB_KEYS if getattr(a, k) is not None}}


def _size_run(a, regime: str, size: str, stages: list, variants: list, work: str) -> dict:
    """Both sides (and the extra rows) on one regime's job at one size; prints their table rows and returns the
    results, ratios and arithmetic floor of this (regime, size)."""
    spec = _spec(a, regime)
    label = size + spec["label"]
    steps = spec["steps_tiny"] if size == "tiny" else spec["steps_30m"]
    samples = spec["prompts_per_step"] * spec["n"]
    if steps <= a.warmup:
        raise SystemExit(f"--steps-{size} must exceed --warmup ({a.warmup}); got {steps} ({regime})")
    size_dir = os.path.join(work, regime, size) if regime != "default" else os.path.join(work, size)
    model_dir, prompts, n_params, matmul_params = prepare(size_dir, size, max(4096, steps * spec["prompts_per_step"]),
                                                          a.seed, regime)
    job = {"model_dir": model_dir, "prompts": prompts, "steps": steps, "prompts_per_step": spec["prompts_per_step"],
           "n": spec["n"], "micro_batch": spec["micro_batch"], "max_new_tokens": spec["max_new_tokens"], "lr": a.lr,
           "beta": a.beta, "seed": a.seed, "threads": a.threads, "temperature": 1.0,
           "log_prob_micro_batch": spec["micro_batch"] if spec["same_log_prob_chunks"] else None}
    sides = [("trl", lambda: run_trl(job, os.path.join(size_dir, "trl"), a.timeout))]
    sides += [(f"verl_ds ZeRO-{z}", lambda z=z: run_verl_ds(job, z, os.path.join(size_dir, f"verl_ds_z{z}"),
                                                             a.timeout)) for z in stages]
    sides += [(f"verl_ds {name}", lambda i=i, pairs=pairs: run_verl_ds(
        job, stages[0], os.path.join(size_dir, f"verl_ds_variant{i}"), a.timeout, pairs))
        for i, (name, pairs) in enumerate(variants)]
    runs, results, verl_rows = {side: [] for side, _ in sides}, {}, {}
    for _ in range(a.repeats - 1):  # the sides in turn, so that a slower hour weighs on each of them alike
        for side, fn in sides:
            runs[side].append(fn()[0])
    for side, fn in sides:
        rows, wall = fn()
        if side.startswith("verl_ds"):
            verl_rows[side] = rows
        s = results[label, side] = summarise(rows, a.warmup, tuple(runs[side]))
        print(f"{label:5s} {side:16s} {len(rows):5d} {s['step_s']:7.3f} {s['cpu_s']:10.3f} {s['tokens_per_s']:7.0f} "
              f"{s['cpu_tokens_per_s']:9.0f} {s['score_first']:11.3f} {s['score_last']:10.3f} {wall:7.0f}", flush=True)
    trl_s, ours = results[label, "trl"], results[label, f"verl_ds ZeRO-{stages[0]}"]
    key = spec["prefix"] + ("tiny" if size == "tiny" else "big")
    ratios = {f"{key}_step_ratio": ours["step_s"] / trl_s["step_s"],
              f"{key}_tokens_per_s_ratio": ours["tokens_per_s"] / trl_s["tokens_per_s"],
              f"{key}_cpu_step_ratio": ours["cpu_s"] / trl_s["cpu_s"],
              f"{key}_cpu_tokens_per_s_ratio": ours["cpu_tokens_per_s"] / trl_s["cpu_tokens_per_s"],
              f"{key}_score_last_diff": ours["score_last"] - trl_s["score_last"]}
    head = verl_rows[f"verl_ds ZeRO-{stages[0]}"]
    note = ""
    if regime == "long_diverse":  # how little the samples of a prompt have in common
        share, length = shared_prefix_share(model_dir, prompts, spec["n"], spec["max_new_tokens"], seed=a.seed)
        ratios[f"{key}_shared_prefix_share"] = share
        measured = head[a.warmup:] or head
        note = (f"; responses {statistics.fmean(r['response_len'] for r in measured):.0f} tokens on average (verl_ds's "
                f"measured steps), {100 * share:.1f}% of response tokens in a prefix shared with another sample of "
                f"the prompt ({length:.0f}-token samples at the initial weights)")
    print(f"      ({label}: {n_params / 1e6:.2f}M parameters{note})", flush=True)
    cfg = SIZES[size]  # the update's products: a micro-batch's tokens x hidden x MLP width, the best-fed shape
    m_tokens = spec["micro_batch"] * (spec["max_new_tokens"] + 8)
    rate = max(gemm_rate(m_tokens, cfg["hidden_size"], cfg["intermediate_size"], a.threads),
               gemm_rate(m_tokens, cfg["intermediate_size"], cfg["hidden_size"], a.threads))
    floor = arithmetic_floor(head, a.warmup, samples, matmul_params, a.beta, rate)
    floor["shared"] = arithmetic_floor(head, a.warmup, samples, matmul_params, a.beta, rate, spec["n"], shared=True)
    floor["rate"] = rate
    ratios[f"{key}_floor_step_ratio"] = floor["floor_s"] / trl_s["step_s"]
    return {"results": results, "ratios": ratios, "floor": (label, floor)}


def _print_summary(results: dict, floors: dict, stages: list, threads: int) -> None:
    print("\nverl_ds per-phase profile of one step (the measured step nearest the median), in wall and CPU seconds:")
    for (label, side), s in results.items():
        for clock in ("wall", "cpu"):
            if f"profile_{clock}" in s:
                print(_profile(f"{label} {side} {clock}", s[f"profile_{clock}"]))
    print("\nArithmetic floor: the matrix products alone at the measured float32 GEMM rate on "
          f"{threads} thread(s), computing every sample's prompt in every pass (as TRL does), and with each "
          "prompt once per group in the generation, reference and update passes (verl_ds's model.share_prompts and "
          "rollout.share), each response's last token left out of the scoring passes (shared response "
          "prefixes counted for every sample: verl_ds feeds them once, model.share_response_prefixes):")
    for label, f in floors.items():
        trl_s, ours = results[label, "trl"]["step_s"], results[label, f"verl_ds ZeRO-{stages[0]}"]["step_s"]
        sh = f["shared"]
        print(f"  {label}: {f['flop']:.3g} FLOP per step ({f['tokens']:.0f} tokens per pass) at {f['rate'] / 1e9:.1f} "
              f"GFLOP/s = {f['floor_s']:.3f} s/step, {f['floor_s'] / trl_s:.2f} x TRL's {trl_s:.3f} s "
              f"({100 * f['floor_s'] / trl_s:.0f}% of the rate); shared prompts: {sh['flop']:.3g} FLOP "
              f"({sh['scored_tokens']:.0f} tokens per pass) = {sh['floor_s']:.3f} s/step, "
              f"verl_ds ZeRO-{stages[0]} {ours:.3f} s ({100 * sh['floor_s'] / ours:.0f}% of the rate)")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", default="default", help="comma-separated, from " + ", ".join(REGIMES))
    p.add_argument("--sizes", default="tiny,30m", help="comma-separated, from " + ", ".join(SIZES))
    p.add_argument("--steps-tiny", type=int, default=None, help="default: the regime's (default 40, long_diverse 5)")
    p.add_argument("--steps-30m", type=int, default=None, help="default: the regime's (default 6, long_diverse 4)")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped from the timing (not from the scores)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="default: the regime's (32, long_diverse 8)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (TRL num_generations); the regime's: 4")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per forward/backward (TRL per-device batch); the regime's: 16, long_diverse 8")
    p.add_argument("--max-new-tokens", type=int, default=None, help="the regime's: 8, long_diverse 256")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.01, help="KL coefficient (k3 in the loss; 0: no reference)")
    p.add_argument("--zero-stages", default="0,3", help="verl_ds ZeRO stages to run; the first is the headline")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side, interleaved; the timing pools their "
                   "measured steps (a shared machine's speed drifts by 2x from one hour to the next)")
    p.add_argument("--verl-ds-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                   help="an extra verl_ds row (at the first of --zero-stages) with these launch/train.py overrides, "
                        "e.g. 'no prefix sharing:model.share_response_prefixes=false'; repeatable, not used in the "
                        "ratios")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per side and size")
    p.add_argument("--work-dir", default=None, help="keep models, prompts and runs here (default: a temp dir)")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = _parse(argv)
    if a.trl_worker:
        return trl_worker(a.trl_worker)
    regimes = [r.strip() for r in a.regime.split(",") if r.strip()]
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    stages = [int(z) for z in a.zero_stages.split(",")]
    bad = [r for r in regimes if r not in REGIMES]
    if bad or not regimes:
        raise SystemExit(f"--regime must name regimes from {sorted(REGIMES)}; got {bad or a.regime!r}")
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
    for regime in regimes:  # refused before any run starts
        spec = _spec(a, regime)
        samples = spec["prompts_per_step"] * spec["n"]
        if spec["micro_batch"] < 1 or samples % spec["micro_batch"]:
            raise SystemExit(f"--micro-batch must divide prompts per step x n = {samples}; got {spec['micro_batch']}")
    try:
        import transformers
        import trl
    except ImportError as exc:
        raise SystemExit(f"e2e_vs_trl needs TRL ({exc}): pip install -c <(echo torch==$(python -c 'import torch; "
                         "print(torch.__version__)')) 'trl>=1.16'") from None
    work = a.work_dir or tempfile.mkdtemp(prefix="verl_ds_vs_trl_")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    jobs = "; ".join(f"{r}: {j['prompts_per_step']} prompts x n={j['n']} per step, micro-batch {j['micro_batch']}, "
                     f"max_new_tokens {j['max_new_tokens']}" for r, j in ((r, _spec(a, r)) for r in regimes))
    print(f"e2e_vs_trl: GRPO, {jobs}, lr {a.lr}, beta {a.beta}, 1 process, CPU, OMP_NUM_THREADS={a.threads}, "
          f"TRL {trl.__version__}, transformers {transformers.__version__}, verl_ds {_revision()}, "
          f"load average {load:.1f}, {a.repeats} run(s) of each side, work dir {work}")
    header = f"{'size':5s} {'side':16s} {'steps':>5s} {'s/step':>7s} {'cpu s/step':>10s} {'tok/s':>7s} " \
             f"{'tok/cpu-s':>9s} {'score first':>11s} {'score last':>10s} {'wall s':>7s}"
    print(header + "\n" + "-" * len(header), flush=True)
    results, ratios, floors = {}, {}, {}
    for regime in regimes:
        for size in sizes:
            out = _size_run(a, regime, size, stages, variants, work)
            results.update(out["results"])
            ratios.update(out["ratios"])
            floors[out["floor"][0]] = out["floor"][1]
    _print_summary(results, floors, stages, a.threads)
    print(f"\nratios use verl_ds ZeRO-{stages[0]}; step ratio = verl_ds s/step / TRL s/step (< 1: verl_ds faster), "
          "tokens/s ratio = verl_ds / TRL (wall), cpu step ratio = the same in process CPU seconds (less sensitive to "
          "other load), score diff = verl_ds - TRL (last 10% of steps), floor step ratio = the unshared arithmetic "
          "floor / TRL s/step, long_*: the long_diverse regime (shared prefix share: see its size line)")
    print("e2e_vs_trl " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()) + f" load={load:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verl-ds-worker"]:  # before argparse: the rest are launch/train.py's arguments
        sys.exit(verl_ds_worker(sys.argv[2], sys.argv[3:]))
    main()
