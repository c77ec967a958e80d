"""Side-by-side CPU benchmark of the verl_ds.algos torch paths against the naive formulas and the peers.

    python benchmarks/numerics.py            # the default shapes: [8192, 32000] logits, GAE at B=256, T=2048
    python benchmarks/numerics.py --quick    # tiny shapes, a smoke run (what the test runs)

Rows: median (and min) wall time, GB/s of the input read once, peak extra memory (VmHWM - VmRSS around
one call, VmHWM reset through /proc/self/clear_refs), max abs diff against a float64 reference, and the
share of the machine's CPU other processes used while the row was timed (rows above ~10% are
contended; their min is the better anchor). Peers: TRL and verl are imported when installed; their
CPU paths are also re-implemented here as labelled "-equiv" rows (TRL ``selective_log_softmax``: a
per-sequence logsumexp loop for fp32 and a per-sequence log_softmax for bf16; verl's rmpad path: the
same per token row; verl's GAE: a reverse loop over time steps). Forward rows run under no_grad.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from verl_ds.algos import (
    compute_gae,
    entropy_from_logits,
    full_symmetric_kl,
    logprobs_and_entropy,
    logprobs_from_logits,
)

# --- measurement -----------------------------------------------------------------------------------


def _proc_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_snapshot():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields), os.times()


def _other_cpu_share(before, after) -> float:
    busy0, total0, t0 = before
    busy1, total1, t1 = after
    hz = os.sysconf("SC_CLK_TCK")
    ours = ((t1.user - t0.user) + (t1.system - t0.system)) * hz
    total = max(total1 - total0, 1)
    return max(0.0, ((busy1 - busy0) - ours) / total)


def wait_for_quiet(budget: list, threshold: float = 0.15) -> None:
    """Wait (from a shared budget of seconds) until other processes use < threshold of the CPUs."""
    while budget[0] > 0:
        snap = _cpu_snapshot()
        time.sleep(0.5)
        budget[0] -= 0.5
        if _other_cpu_share(snap, _cpu_snapshot()) < threshold:
            return


def measure(fn, repeat: int, quiet_budget: list):
    """(output, median_s, min_s, n, peak_extra_bytes, other_cpu_share) of fn()."""
    out = fn()  # warm-up, and the output for the accuracy column
    del out
    wait_for_quiet(quiet_budget)
    have_peak = _reset_peak()
    rss0 = _proc_kb("VmRSS")
    out = fn()
    peak = (_proc_kb("VmHWM") - rss0) * 1024 if have_peak else float("nan")
    times = []
    snap = _cpu_snapshot()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    other = _other_cpu_share(snap, _cpu_snapshot())
    return out, statistics.median(times), min(times), len(times), max(peak, 0), other


def _max_abs_diff(a, ref) -> float:
    return (a.double() - ref).abs().max().item()


class Table:
    def __init__(self, title: str, unit_bytes: int, diff_label: str):
        self.unit_bytes = unit_bytes
        print(f"\n## {title}\n")
        print(f"| implementation | shape | median ms (min) | n | other CPU | GB/s | peak extra mem | {diff_label} |")
        print("|---|---|---|---|---|---|---|---|")

    def row(self, name, shape, med, mn, n, bytes_read, peak, other, diffs):
        mem = f"{peak / 2**20:.0f} MB ({peak / self.unit_bytes:.3f}x)" if peak == peak else "n/a"
        diff = " / ".join(f"{d:.1e}" for d in diffs)
        print(f"| `{name}` | {shape} | {med * 1e3:.1f} ({mn * 1e3:.1f}) | {n} | {other:.0%} | "
              f"{bytes_read / med / 1e9:.2f} | {mem} | {diff} |", flush=True)


# --- peers and naive baselines ---------------------------------------------------------------------


def naive_logprob(logits, labels, t):
    return torch.log_softmax(logits / t if t != 1.0 else logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_logprob_entropy(logits, labels, t):
    logp = torch.log_softmax(logits / t if t != 1.0 else logits, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def trl_equiv_selective_log_softmax(logits, index):
    """TRL ``selective_log_softmax`` (trl/trainer/utils.py): loop over the leading dim."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        return selected - lse
    out = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = torch.log_softmax(row_logits, dim=-1)
        out.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def trl_equiv_entropy(logits, chunk_size=128):
    """TRL ``entropy_from_logits``: log_softmax over chunks of 128 rows."""
    flat = logits.reshape(-1, logits.shape[-1])
    ents = [-(torch.exp(lp) * lp).sum(-1) for lp in (torch.log_softmax(c, dim=-1) for c in flat.split(chunk_size))]
    return torch.cat(ents).reshape(logits.shape[:-1])


def verl_equiv_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl ``compute_gae_advantage_return`` without the final whitening: a reverse loop over t."""
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def _real_peers():
    peers = {}
    try:
        from trl.trainer.utils import entropy_from_logits as trl_entropy
        from trl.trainer.utils import selective_log_softmax
        peers["trl.selective_log_softmax"] = selective_log_softmax
        peers["trl.entropy_from_logits"] = trl_entropy
    except Exception as exc:  # not installed here, or an incompatible version
        print(f"(trl not importable: {type(exc).__name__}; its -equiv rows stand in)")
    try:
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return
        from verl.utils.torch_functional import logprobs_from_logits as verl_logprobs
        peers["verl.logprobs_from_logits"] = verl_logprobs
        peers["verl.compute_gae_advantage_return"] = compute_gae_advantage_return
    except Exception as exc:
        print(f"(verl not importable: {type(exc).__name__}; its -equiv rows stand in)")
    return peers


# --- float64 references ----------------------------------------------------------------------------


def ref_logprob_entropy(logits2d, labels, t, rows=512):
    lp, ent = [], []
    for s in range(0, logits2d.shape[0], rows):
        x = logits2d[s:s + rows].double() / t
        logp = torch.log_softmax(x, dim=-1)
        lp.append(logp.gather(-1, labels[s:s + rows, None]).squeeze(-1))
        ent.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lp), torch.cat(ent)


# --- sections --------------------------------------------------------------------------------------


def bench_logprob(b, t_len, vocab, dtype, temperature, repeat, peers, budget, with_backward):
    torch.manual_seed(0)
    logits3d = (torch.randn(b, t_len, vocab) * 3).to(dtype)
    labels3d = torch.randint(0, vocab, (b, t_len))
    logits2d, labels2d = logits3d.view(-1, vocab), labels3d.view(-1)
    n_bytes = logits3d.numel() * logits3d.element_size()
    ref_lp, ref_ent = ref_logprob_entropy(logits2d, labels2d, temperature)
    shape = f"B{b}xT{t_len}xV{vocab} {str(dtype).replace('torch.', '')}" + (
        f" t={temperature}" if temperature != 1.0 else "")
    t = temperature

    def scaled(x):  # what TRL and verl do before their log-prob call: a full-size division
        return x / t if t != 1.0 else x

    tab = Table(f"log-prob of the sampled token: {shape}", n_bytes, "max abs diff vs fp64")
    rows = [
        ("naive log_softmax+gather", lambda: naive_logprob(logits3d, labels3d, t)),
        ("trl-equiv.selective_log_softmax", lambda: trl_equiv_selective_log_softmax(scaled(logits3d), labels3d)),
        ("verl-equiv.logprobs_from_logits[rmpad]",
         lambda: trl_equiv_selective_log_softmax(scaled(logits2d), labels2d)),
    ]
    if "trl.selective_log_softmax" in peers:
        f = peers["trl.selective_log_softmax"]
        rows.append(("trl.selective_log_softmax", lambda: f(scaled(logits3d), labels3d)))
    if "verl.logprobs_from_logits" in peers:
        f = peers["verl.logprobs_from_logits"]
        rows.append(("verl.logprobs_from_logits[rmpad]", lambda: f(scaled(logits2d), labels2d)))
    rows.append(("verl_ds.logprobs_from_logits", lambda: logprobs_from_logits(logits3d, labels3d, t)))
    with torch.no_grad():
        for name, fn in rows:
            out, med, mn, n, peak, other = measure(fn, repeat, budget)
            tab.row(name, shape, med, mn, n, n_bytes, peak, other, [_max_abs_diff(out.reshape(-1), ref_lp)])
            del out

    tab = Table(f"log-prob + entropy: {shape}", n_bytes, "max abs diff vs fp64 (logp / entropy)")
    rows = [
        ("naive log_softmax (+gather, +entropy)", lambda: naive_logprob_entropy(logits3d, labels3d, t)),
        ("trl-equiv.selective_log_softmax+entropy",
         lambda: (lambda x: (trl_equiv_selective_log_softmax(x, labels3d), trl_equiv_entropy(x)))(scaled(logits3d))),
    ]
    if "trl.selective_log_softmax" in peers:
        f, g = peers["trl.selective_log_softmax"], peers["trl.entropy_from_logits"]
        rows.append(("trl.selective_log_softmax+entropy_from_logits",
                     lambda: (lambda x: (f(x, labels3d), g(x)))(scaled(logits3d))))
    rows.append(("verl_ds.logprobs_and_entropy", lambda: logprobs_and_entropy(logits3d, labels3d, t)))
    with torch.no_grad():
        for name, fn in rows:
            (lp, ent), med, mn, n, peak, other = measure(fn, repeat, budget)
            tab.row(name, shape, med, mn, n, n_bytes, peak, other,
                    [_max_abs_diff(lp.reshape(-1), ref_lp), _max_abs_diff(ent.reshape(-1), ref_ent)])
            del lp, ent

    if not with_backward:
        return
    # forward + backward of sum(w1 * logp + w2 * entropy): the gradient itself is one logits-sized tensor
    w1, w2 = torch.randn(b, t_len), torch.randn(b, t_len)
    x64 = logits3d.double().requires_grad_()
    lp64, ent64 = naive_logprob_entropy(x64, labels3d, t)
    ((w1 * lp64).sum() + (w2 * ent64).sum()).backward()
    ref_grad = x64.grad.view(-1, vocab)
    del x64, lp64, ent64

    def fwd_bwd(impl):
        def run():
            x = logits3d.detach().requires_grad_()
            lp, ent = impl(x)
            ((w1 * lp).sum() + (w2 * ent).sum()).backward()
            return x.grad
        return run

    tab = Table(f"log-prob + entropy, forward + backward: {shape}", n_bytes, "max abs diff of grad vs fp64")
    for name, impl in (("naive autograd", lambda x: naive_logprob_entropy(x, labels3d, t)),
                       ("verl_ds.logprobs_and_entropy", lambda x: logprobs_and_entropy(x, labels3d, t))):
        grad, med, mn, n, peak, other = measure(fwd_bwd(impl), max(1, repeat // 2), budget)
        tab.row(name, shape, med, mn, n, n_bytes, peak, other, [_max_abs_diff(grad.view(-1, vocab), ref_grad)])
        del grad


def bench_entropy_only(b, t_len, vocab, repeat, budget):
    torch.manual_seed(0)
    logits = torch.randn(b, t_len, vocab) * 3
    n_bytes = logits.numel() * 4
    _, ref_ent = ref_logprob_entropy(logits.view(-1, vocab), torch.zeros(b * t_len, dtype=torch.long), 1.0)
    shape = f"B{b}xT{t_len}xV{vocab} float32"
    tab = Table(f"entropy only: {shape}", n_bytes, "max abs diff vs fp64")
    with torch.no_grad():
        for name, fn in (("trl-equiv.entropy_from_logits", lambda: trl_equiv_entropy(logits)),
                         ("verl_ds.entropy_from_logits", lambda: entropy_from_logits(logits))):
            out, med, mn, n, peak, other = measure(fn, repeat, budget)
            tab.row(name, shape, med, mn, n, n_bytes, peak, other, [_max_abs_diff(out.reshape(-1), ref_ent)])


def naive_symmetric_kl(x, y):
    lp, lq = torch.log_softmax(x, dim=-1), torch.log_softmax(y, dim=-1)
    return 0.5 * ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)


def bench_symkl(b, t_len, vocab, repeat, budget):
    torch.manual_seed(0)
    x = torch.randn(b, t_len, vocab) * 3
    y = x + torch.randn(b, t_len, vocab) * 0.5
    n_bytes = 2 * x.numel() * 4
    ref = torch.cat([naive_symmetric_kl(x.view(-1, vocab)[s:s + 512].double(), y.view(-1, vocab)[s:s + 512].double())
                     for s in range(0, b * t_len, 512)])
    shape = f"B{b}xT{t_len}xV{vocab} float32"
    tab = Table(f"full-vocabulary symmetric KL (two logits tensors read): {shape}", x.numel() * 4,
                "max abs diff vs fp64")
    with torch.no_grad():
        for name, fn in (("naive log_softmax x2", lambda: naive_symmetric_kl(x, y)),
                         ("verl_ds.full_symmetric_kl", lambda: full_symmetric_kl(x, y))):
            out, med, mn, n, peak, other = measure(fn, repeat, budget)
            tab.row(name, shape, med, mn, n, n_bytes, peak, other, [_max_abs_diff(out.reshape(-1), ref)])
            del out


def bench_gae(b, t_len, repeat, peers, budget, gamma=0.99, lam=0.95):
    torch.manual_seed(0)
    rewards, values = torch.randn(b, t_len), torch.randn(b, t_len)
    lengths = torch.randint(t_len // 4, t_len + 1, (b,))
    mask = torch.arange(t_len)[None, :] < lengths[:, None]  # right padding
    holes = torch.rand(b, t_len) < 0.05  # and short observation spans inside responses
    mask &= ~holes
    maskf = mask.float()
    ref_adv, ref_ret = verl_equiv_gae(rewards.double(), values.double(), maskf.double(), gamma, lam)
    n_bytes = 4 * 4 * b * t_len + b * t_len  # rewards, values, advantages, returns (fp32) + bool mask
    shape = f"B{b}xT{t_len} float32"
    tab = Table(f"masked GAE (gamma={gamma}, lambda={lam}): {shape}", 4 * b * t_len,
                "max abs diff vs fp64 (adv / returns)")
    rows = [("verl-equiv.compute_gae_advantage_return (loop over t)",
             lambda: verl_equiv_gae(rewards, values, maskf, gamma, lam))]
    if "verl.compute_gae_advantage_return" in peers:
        f = peers["verl.compute_gae_advantage_return"]
        rows.append(("verl.compute_gae_advantage_return (whitened: diff not comparable)",
                     lambda: f(rewards, values, maskf, gamma, lam)))
    rows.append(("verl_ds.compute_gae", lambda: compute_gae(rewards, values, mask, gamma, lam)))
    with torch.no_grad():
        meds = {}
        for name, fn in rows:
            (adv, ret), med, mn, n, peak, other = measure(fn, repeat, budget)
            meds[name] = med
            tab.row(name, shape, med, mn, n, n_bytes, peak, other,
                    [_max_abs_diff(adv, ref_adv), _max_abs_diff(ret, ref_ret)])
    loop = meds[rows[0][0]]
    print(f"\nspeed-up of verl_ds.compute_gae over the per-step loop: {loop / meds['verl_ds.compute_gae']:.1f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per row (default 5, quick 2)")
    parser.add_argument("--quiet-wait", type=float, default=None,
                        help="seconds in total to wait for other processes to go quiet before rows "
                             "(default 120, quick 0)")
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                        help="also time forward+backward (fp32 only)")
    args = parser.parse_args(argv)
    repeat = args.repeat or (2 if args.quick else 5)
    budget = [args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 120.0)]
    b, t_len, vocab = (2, 64, 1000) if args.quick else (8, 1024, 32000)
    gb, gt = (8, 128) if args.quick else (256, 2048)

    print(f"# verl_ds.algos numerics benchmark\n\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, capability {torch.backends.cpu.get_cpu_capability()}; "
          f"python {sys.version.split()[0]}")
    peers = _real_peers()
    bench_logprob(b, t_len, vocab, torch.float32, 1.0, repeat, peers, budget, args.backward)
    bench_logprob(b, t_len, vocab, torch.bfloat16, 1.0, repeat, peers, budget, False)
    bench_logprob(b, t_len, vocab, torch.float32, 0.7, repeat, peers, budget, False)
    bench_entropy_only(b, t_len, vocab, repeat, budget)
    bench_symkl(b, t_len, vocab, repeat, budget)
    bench_gae(gb, gt, repeat, peers, budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
