"""Throughput building blocks on CPU, each against its baseline timed in the same run.

    python benchmarks/throughput.py            # the default shapes (a few minutes on 2 cores)
    python benchmarks/throughput.py --quick    # tiny shapes, a smoke run (what the test runs)

1. The update phase: forward + backward of the actor (a tiny Llama) and the critic (CriticLM on the same
   backbone config) over a batch whose response lengths are uniform in 1..R (R = 128) after prompts of
   8..32 tokens: padded fixed micro-batches (``PolicyModel.get_logprob`` / ``ValueModel.get_values``,
   sdpa) vs remove padding (``verl_ds.packing.pack``, ``verl_ds_varlen_sdpa``) with token-budget
   micro-batches of the padded micro-batch's size in tokens. Same losses (``policy_loss`` and
   ``value_loss`` over the global token count). Figure: real tokens per second.
2. The log-prob phase (no grad) at N = 8192 tokens, H = 1024, V = 32000, float32: logits
   (``hidden @ W.T``) + ``logprobs_and_entropy`` vs ``fused_linear_logprobs``, and verl's
   ``FusedLinearForPPO`` when importable (else a re-implementation of its approach, labelled -equiv:
   512-token chunks with full-vocabulary float32 logits). Peak extra memory is VmHWM - VmRSS around one
   call (VmHWM reset through /proc/self/clear_refs, glibc made to unmap freed blocks); accuracy is the
   max abs difference from float64 on the first rows.

The last line is ``throughput packed_speedup=<x> fused_lm_head_peak_ratio=<y> fused_lm_head_time_ratio=<z>``:
x = packed over padded real tokens per second of process CPU time (both sides run the same threads on
the same ops; on a shared machine wall time mostly measures the other processes: in this project's
runs the wall ratio of one update ranged 1.2-2.3x while the CPU ratio stayed 1.7-2.0x; the wall figures
are printed too); y = fused peak extra memory over the logits path's; z = fused wall time over the
logits path's (wall, as the two thread differently: one large matmul vs tiles split between threads).
Runs alternate between the compared sides and the minimum of each is used.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

# Before torch starts OpenMP: idle OpenMP threads sleep instead of spinning. On a shared machine spinning
# threads fight the other processes for the cores, and every op's fork/join then waits up to a scheduler
# tick (measured here: one padded update 1.9 s passive, 7-10 s spinning). It is the same for both sides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.algos import logprobs_and_entropy, policy_loss, value_loss  # noqa: E402
from verl_ds.algos.fused_lm_head import fused_linear_logprobs  # noqa: E402
from verl_ds.models import CriticLM, PolicyModel, ValueModel  # noqa: E402
from verl_ds.models.packed_forward import packed_logprobs, packed_values  # noqa: E402
from verl_ds.models.varlen_attention import use_varlen_attention  # noqa: E402
from verl_ds.packing import count_micro_batches, pack, token_budget_micro_batches  # noqa: E402

FULL = dict(B=64, P=32, R=128, mb=8, hidden=128, layers=4, vocab=2000, repeat=2,
            lp_n=8192, lp_h=1024, lp_v=32000, lp_repeat=1)
# the quick log-prob shapes keep the logits at 16 MiB: a 1 MiB allocation can land in pages already resident and
# read as 0 bytes of peak, which made the quick run's peak ratio a division by zero
QUICK = dict(B=8, P=6, R=16, mb=2, hidden=32, layers=2, vocab=100, repeat=1, lp_n=1024, lp_h=32, lp_v=4096,
             lp_repeat=1)


# ---- measurement --------------------------------------------------------------------------------------

def _proc_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def unpooled_malloc() -> None:
    """glibc: map every allocation over 64 KiB and unmap it on free, so RSS follows live memory."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn):
    """(VmHWM - VmRSS around one call of fn, outputs included, or NaN where /proc cannot reset VmHWM; fn's
    output)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan"), fn()
    before = _proc_kb("VmRSS")
    out = fn()
    return float(max((_proc_kb("VmHWM") - before) * 1024, 0)), out


# ---- 1. update phase -------------------------------------------------------------------------------------

def make_batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P, R, V = cfg["B"], cfg["P"], cfg["R"], cfg["vocab"]
    lo = max(1, P // 4)
    prompt_len = torch.randint(lo, P + 1, (B,), generator=g)
    resp_len = torch.randint(1, R + 1, (B,), generator=g)
    cols = torch.arange(P + R).unsqueeze(0)
    mask = ((cols >= P - prompt_len.unsqueeze(1)) & (cols < P)) | ((cols >= P) & (cols < P + resp_len.unsqueeze(1)))
    obs = torch.where(mask, torch.randint(3, V, (B, P + R), generator=g), 0)
    old_lp = -torch.rand(B, R, generator=g) * 3
    adv, ret, old_v = (torch.randn(B, R, generator=g) for _ in range(3))
    return obs, mask, old_lp, adv, ret, old_v


def make_models(cfg, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    h = cfg["hidden"]
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=h, intermediate_size=int(h * 2.6875),
                         num_hidden_layers=cfg["layers"], num_attention_heads=max(1, h // 32),
                         num_key_value_heads=max(1, h // 64), max_position_embeddings=cfg["P"] + cfg["R"] + 8,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    actor = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    critic = CriticLM.from_causal_lm_config(config, attn_implementation="sdpa")
    return actor, critic


def _step_losses(lp, ent, values, rows, rmask, batch, G):
    _, _, old_lp, adv, ret, old_v = batch
    pl, _ = policy_loss(lp, old_lp[rows], adv[rows], rmask, normalizer=G)
    vl, _ = value_loss(values, old_v[rows], ret[rows], rmask, normalizer=G)
    ent_term = (ent * rmask).sum() / G
    return pl - 0.01 * ent_term, vl


def update_padded(actor, critic, batch, cfg):
    obs, mask = batch[0], batch[1]
    R, mb = cfg["R"], cfg["mb"]
    G = int(mask[:, -R:].sum())
    policy, value = PolicyModel(actor), ValueModel(critic)
    for s in range(0, obs.shape[0], mb):
        rows = list(range(s, min(s + mb, obs.shape[0])))
        o, m = obs[rows], mask[rows]
        lp, ent = policy.get_logprob(o, o[:, -R:], m, 1.0, return_entropy=True)
        values = value.get_values(o, m, R)
        al, vl = _step_losses(lp, ent, values, rows, m[:, -R:], batch, G)
        (al + vl).backward()


def update_packed(actor, critic, batch, cfg, fused=False):
    obs, mask = batch[0], batch[1]
    R = cfg["R"]
    G = int(mask[:, -R:].sum())
    lengths = mask.sum(1).tolist()
    budget = cfg["mb"] * obs.shape[1]  # the padded micro-batch's size in tokens
    for rows in token_budget_micro_batches(lengths, budget, count_micro_batches(lengths, budget)):
        p = pack(obs[rows], mask[rows])
        lp, ent = packed_logprobs(actor, p, R, 1.0, compute_entropy=True, fused_lm_head=fused)
        values = packed_values(critic, p, R)
        al, vl = _step_losses(lp, ent, values, rows, mask[rows][:, -R:], batch, G)
        (al + vl).backward()


def _grads(*models):
    return [p.grad.clone() for m in models for p in m.parameters() if p.grad is not None]


def bench_update(cfg):
    print(f"## update phase: actor + critic forward/backward, B={cfg['B']}, prompts {max(1, cfg['P'] // 4)}.."
          f"{cfg['P']}, responses uniform 1..R={cfg['R']}, tiny Llama (H={cfg['hidden']}, {cfg['layers']} layers, "
          f"V={cfg['vocab']}), {torch.get_num_threads()} threads")
    batch = make_batch(cfg)
    actor, critic = make_models(cfg)
    obs, mask = batch[0], batch[1]
    real = int(mask.sum())
    lengths = mask.sum(1).tolist()
    budget = cfg["mb"] * obs.shape[1]
    k = count_micro_batches(lengths, budget)
    print(f"real tokens {real} of {obs.numel()} padded ({real / obs.numel():.0%}); padded: "
          f"{-(-obs.shape[0] // cfg['mb'])} micro-batches of {cfg['mb']} rows; packed: {k} micro-batches of <= "
          f"{budget} tokens")
    packed_actor, packed_critic = make_models(cfg)
    use_varlen_attention(packed_actor), use_varlen_attention(packed_critic)
    sides = {"padded (PolicyModel/ValueModel, sdpa)": (lambda: update_padded(actor, critic, batch, cfg),
                                                       (actor, critic)),
             "remove padding + token budget (varlen sdpa)": (lambda: update_packed(packed_actor, packed_critic,
                                                                                   batch, cfg), (packed_actor,
                                                                                                 packed_critic))}
    wall = {name: [] for name in sides}
    cpu = {name: [] for name in sides}
    grads = {}
    for rep in range(cfg["repeat"] + 1):  # the first round warms up; the sides alternate
        for name, (fn, models) in sides.items():
            for m in models:
                m.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if rep:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            grads[name] = _grads(*models)
    g_pad, g_pk = grads.values()
    diff = max(float((a - b).abs().max()) for a, b in zip(g_pad, g_pk))
    print("| path | wall s min (median) | real tokens/s (wall) | CPU s min (median) | real tokens per CPU-s |")
    print("|---|---|---|---|---|")
    for name in sides:
        w, c = wall[name], cpu[name]
        print(f"| {name} | {min(w):.2f} ({statistics.median(w):.2f}) | {real / min(w):,.0f} | {min(c):.2f} "
              f"({statistics.median(c):.2f}) | {real / min(c):,.0f} |")
    pad, pk = sides
    by_wall, by_cpu = min(wall[pad]) / min(wall[pk]), min(cpu[pad]) / min(cpu[pk])
    print(f"packed / padded: {by_cpu:.2f}x tokens per CPU-second, {by_wall:.2f}x tokens per wall second; max abs "
          f"gradient difference {diff:.2e}")
    return by_cpu


# ---- 2. log-prob phase -----------------------------------------------------------------------------------

def logits_path(h, w, y):
    return logprobs_and_entropy(h @ w.T, y, 1.0)


def fused_path(h, w, y):
    return fused_linear_logprobs(h, w, y, 1.0)


def verl_equiv(h, w, y, chunk=512):
    """verl's FusedLinearForPPO approach (verl/utils/experimental/torch_functional.py): per 512-token
    chunk, full-vocabulary float32 logits, log_softmax and softmax."""
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        logits = (h[s:s + chunk] @ w.T).float()
        ls = logits.log_softmax(-1)
        lps.append(ls.gather(-1, y[s:s + chunk].unsqueeze(-1)).squeeze(-1))
        ents.append(torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def _verl_fused():
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
    except Exception:  # noqa: BLE001 - not installed, or an incompatible version
        return None
    mod = FusedLinearForPPO()
    return lambda h, w, y: mod(h, w, y, temperature=1.0)


def bench_logprob(cfg):
    n, hdim, v = cfg["lp_n"], cfg["lp_h"], cfg["lp_v"]
    print(f"\n## log-prob phase (no grad): N={n}, H={hdim}, V={v}, float32, {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hdim, generator=g)
    w = torch.randn(v, hdim, generator=g) / hdim ** 0.5 * 2
    y = torch.randint(0, v, (n,), generator=g)
    k = min(n, 64)
    ref = torch.log_softmax(h[:k].double() @ w.double().T, -1)
    ref_lp, ref_ent = ref.gather(-1, y[:k].unsqueeze(-1)).squeeze(-1), -(ref.exp() * ref).sum(-1)
    rows = [("logits + verl_ds.logprobs_and_entropy", logits_path), ("verl_ds.fused_linear_logprobs", fused_path)]
    verl = _verl_fused()
    rows.append(("verl FusedLinearForPPO", verl) if verl else ("verl-equiv (512-token chunks, full-V logits)",
                                                               verl_equiv))
    if verl is None:
        print("(verl is not installed: its FusedLinearForPPO row is the -equiv re-implementation)")
    print("| implementation | wall s min (median) | CPU s min | peak extra MiB | max abs diff lp / ent vs float64 |")
    print("|---|---|---|---|---|")
    wall = {name: [] for name, _ in rows}
    cpu = {name: [] for name, _ in rows}
    peaks, diffs = {}, {}

    def timed(name, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(h, w, y)
        wall[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
        return out

    with torch.no_grad():
        for name, fn in rows:  # one call each: peak memory, accuracy and a first time
            peaks[name], (lp, ent) = peak_extra_bytes(lambda name=name, fn=fn: timed(name, fn))
            diffs[name] = (float((lp[:k].double() - ref_lp).abs().max()),
                           float((ent[:k].double() - ref_ent).abs().max()))
            del lp, ent
        for _ in range(cfg["lp_repeat"]):  # more times for the two compared rows, alternating
            for name, fn in rows[:2]:
                timed(name, fn)
    for name, _ in rows:
        w_, c_ = wall[name], cpu[name]
        print(f"| {name} | {min(w_):.2f} ({statistics.median(w_):.2f}) | {min(c_):.2f} | "
              f"{peaks[name] / 2 ** 20:.1f} | {diffs[name][0]:.1e} / {diffs[name][1]:.1e} |")
    lg, fu = rows[0][0], rows[1][0]
    if not peaks[lg] > 0:  # nothing measurable (or NaN: no /proc): say so rather than divide by it
        raise SystemExit(f"throughput: the logits path's peak extra memory read as {peaks[lg]} bytes; the log-prob "
                         f"shapes are too small to measure (N={n}, V={v})")
    peak_ratio, time_ratio = peaks[fu] / peaks[lg], min(wall[fu]) / min(wall[lg])
    print(f"fused / logits path: peak extra {peak_ratio:.3f}x, wall time {time_ratio:.2f}x, CPU time "
          f"{min(cpu[fu]) / min(cpu[lg]):.2f}x (the logits alone are {n * v * 4 / 2 ** 20:.0f} MiB)")
    return peak_ratio, time_ratio


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    unpooled_malloc()  # process-wide: RSS must follow live memory for the peaks (the smoke test runs us in a process of our own)
    try:
        speedup = bench_update(cfg)
        peak_ratio, time_ratio = bench_logprob(cfg)
    finally:
        torch.set_num_threads(before)
    print(f"throughput packed_speedup={speedup:.2f} fused_lm_head_peak_ratio={peak_ratio:.3f} "
          f"fused_lm_head_time_ratio={time_ratio:.2f}")
    return speedup, peak_ratio, time_ratio


if __name__ == "__main__":
    main()
