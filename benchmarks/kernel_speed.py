"""Benchmark the three hot paths: naive torch, our torch path (verl_ds.algos), our Triton kernels,
and the peers' functions when installed (TRL, verl).

For each case it prints the median time, the achieved bandwidth (the bytes a fused single pass
must move, divided by the time) against the device's memory bandwidth measured in the same run
by a large copy, the peak extra memory of one call, and the max abs difference from the naive
reference. On a machine without CUDA it runs the torch paths only (the Triton interpreter is a
correctness tool, not something to time) and says so.

    python benchmarks/kernel_speed.py              # the default shapes (needs a GPU-sized memory)
    python benchmarks/kernel_speed.py --quick      # small shapes, for CPU or a smoke run
    python benchmarks/kernel_speed.py --sweep      # also time the log-prob kernel over launch shapes
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- measurement -----------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeats: int) -> float:
    """Median seconds per call after a warm-up call (which also compiles Triton kernels)."""
    fn()
    if device.type == "cuda":
        import triton.testing
        # do_bench flushes L2 between calls, so small inputs are not timed from cache
        return triton.testing.do_bench(fn, warmup=5, rep=max(20, 10 * repeats), return_mode="median") / 1e3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _proc_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def peak_extra_bytes(fn, device):
    """Peak memory of one call above what was allocated before it (outputs included); None if unknown."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before
    try:  # Linux: writing 5 to clear_refs resets the RSS high-water mark (VmHWM); see unpooled_malloc
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_kb("VmRSS")
        out = fn()
        del out
        return max(0, (_proc_kb("VmHWM") - before) * 1024)
    except OSError:
        return None


def unpooled_malloc() -> None:
    """Make glibc map every allocation over 64 KiB and unmap it on free, so RSS follows live memory.

    Otherwise freed blocks stay in the heap (the mmap threshold grows to 32 MiB after the first
    free) and the warm-up call hides the next call's peak from VmHWM.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; setting it also stops the dynamic adjustment
    except OSError:
        pass


def measure_bandwidth(device) -> float:
    """Bytes per second of a large device copy (read + write)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), device, 10)
    return 2 * 4 * n / seconds


def available_bytes(device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        return int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1)) * 1024


# --- implementations -------------------------------------------------------------------------------

def _optional(module: str, name: str):
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:  # not installed, or fails to import on this machine
        return None


def naive_logprob(logits, labels):
    """log_softmax + gather: the (N, V) log-softmax is materialised (DS-Chat style)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)


def naive_logprob_entropy(logits, labels):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def naive_symkl(logits, ref_logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    logq = torch.log_softmax(ref_logits.float(), dim=-1)
    return 0.5 * ((logp.exp() - logq.exp()) * (logp - logq)).sum(-1)


def naive_gae(rewards, values, mask, gamma, lam):
    """The per-step loop over T, vectorised over rows (verl's compute_gae_advantage_return shape)."""
    v_next = torch.zeros(rewards.shape[0], device=rewards.device)
    g = torch.zeros_like(v_next)
    adv = torch.empty_like(rewards)
    m = mask.float()
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * v_next - values[:, t]
        g_new = delta + gamma * lam * g
        v_next = values[:, t] * m[:, t] + (1 - m[:, t]) * v_next
        g = g_new * m[:, t] + (1 - m[:, t]) * g
        adv[:, t] = g
    return adv, adv + values


# the log-prob implementations that return the entropy too (the others' gradients differ)
BOTH_OUTPUTS = ("naive +entropy", "ours torch", "ours triton", "verl logprobs_from_logits+entropy")


def implementations(device, triton_ok: bool):
    """name -> callable per hot path; a None callable is listed as not available, with the reason."""
    ours_lp = _optional("verl_ds.algos.logprob", "logprobs_and_entropy_torch")
    ours_kl = _optional("verl_ds.algos.full_kl", "full_symmetric_kl_torch")
    ours_gae = _optional("verl_ds.algos.gae", "compute_gae_torch")
    trl_sls = _optional("trl.trainer.utils", "selective_log_softmax")
    verl_lp = _optional("verl.utils.torch_functional", "logprobs_from_logits")
    verl_ent = _optional("verl.utils.torch_functional", "entropy_from_logits")
    verl_gae = _optional("verl.trainer.ppo.core_algos", "compute_gae_advantage_return")
    tri = {}
    if triton_ok:
        from verl_ds.kernels.gae import compute_gae
        from verl_ds.kernels.logprob import logprobs_and_entropy
        from verl_ds.kernels.symkl import full_symmetric_kl
        tri = dict(lp=logprobs_and_entropy, kl=full_symmetric_kl, gae=compute_gae)
    no_gpu = "no CUDA device" if not triton_ok else None
    logprob = {
        "naive log_softmax+gather": (naive_logprob, None),
        "naive +entropy": (naive_logprob_entropy, None),
        "ours torch": ((lambda z, y: ours_lp(z, y, 1.0)) if ours_lp else None, "verl_ds.algos.logprob missing"),
        "ours triton": ((lambda z, y: tri["lp"](z, y)) if tri else None, no_gpu),
        "ours triton (no entropy)": ((lambda z, y: tri["lp"](z, y, compute_entropy=False)[0]) if tri else None,
                                     no_gpu),
        "TRL selective_log_softmax": ((lambda z, y: trl_sls(z, y)) if trl_sls else None, "trl not installed"),
        "verl logprobs_from_logits+entropy": (
            (lambda z, y: (verl_lp(z, y), verl_ent(z))) if verl_lp and verl_ent else None, "verl not installed"),
    }
    symkl = {
        "naive two log_softmax": (naive_symkl, None),
        "ours torch": ((lambda z, r: ours_kl(z, r, 1.0)) if ours_kl else None, "verl_ds.algos.full_kl missing"),
        "ours triton": ((lambda z, r: tri["kl"](z, r)) if tri else None, no_gpu),
    }
    gae = {
        "naive per-step loop": (naive_gae, None),
        "ours torch": ((lambda r, v, m, g, l: ours_gae(r, v, m, g, l)) if ours_gae else None,
                       "verl_ds.algos.gae missing"),
        "ours triton scan": ((lambda r, v, m, g, l: tri["gae"](r, v, m, g, l)) if tri else None, no_gpu),
        "verl compute_gae_advantage_return": (
            (lambda r, v, m, g, l: verl_gae(r, v, m.float(), g, l)) if verl_gae else None, "verl not installed"),
    }
    return logprob, symkl, gae


# --- cases -----------------------------------------------------------------------------------------

def _flat(out) -> torch.Tensor:
    """Outputs (a tensor or a tuple) as one flat fp32 vector, to diff against the reference."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([p.detach().float().flatten() for p in parts if p is not None])


def _max_diff(out, ref) -> float:
    a, b = _flat(out), _flat(ref)
    n = min(a.numel(), b.numel())  # a log-prob-only implementation is compared on the log-prob part
    return (a[:n] - b[:n]).abs().max().item()


def run_case(title, impls, args, bytes_moved, ref_fn, device, bandwidth, repeats, results, backward=False):
    print(f"\n{title}  (a fused single pass moves {bytes_moved / 2**20:.1f} MiB; diffs vs the naive fp32 path)")
    print(f"  {'implementation':36s} {'median ms':>10s} {'GB/s':>8s} {'% bw':>6s} {'peak extra MiB':>15s} "
          f"{'max abs diff':>13s}")
    ref = ref_fn(*args)
    for name, (fn, why_not) in impls.items():
        if fn is None:
            print(f"  {name:36s} n/a ({why_not})")
            continue
        call = (lambda f=fn: _fwd_bwd(f, args)) if backward else (lambda f=fn: f(*args))
        try:
            seconds = median_time(call, device, repeats)
            peak = peak_extra_bytes(call, device)
            diff = _max_diff(call(), ref)
        except torch.OutOfMemoryError:
            print(f"  {name:36s} out of memory")
            torch.cuda.empty_cache()
            continue
        gbps = bytes_moved / seconds / 1e9
        peak_s = f"{peak / 2**20:15.1f}" if peak is not None else f"{'n/a':>15s}"
        print(f"  {name:36s} {seconds * 1e3:10.3f} {gbps:8.2f} {100 * gbps * 1e9 / bandwidth:6.1f} {peak_s} "
              f"{diff:13.3g}")
        results.append(dict(case=title, impl=name, ms=seconds * 1e3, gbps=gbps, pct_bw=100 * gbps * 1e9 / bandwidth,
                            peak_extra_mib=None if peak is None else peak / 2**20, max_abs_diff=diff))
    del ref


def _fwd_bwd(fn, args):
    x = args[0].detach().requires_grad_()
    out = fn(x, *args[1:])
    loss = sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)
    loss.backward()
    return x.grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU, or a smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case (CPU; CUDA uses do_bench)")
    parser.add_argument("--ops", default="logprob,symkl,gae", help="comma-separated subset of logprob,symkl,gae")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward of logprob and symkl")
    parser.add_argument("--sweep", action="store_true", help="time the log-prob kernel over (BLOCK_V, num_warps)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        unpooled_malloc()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the Triton kernels would run in the interpreter; timing torch paths only")
    from verl_ds.kernels import dispatch
    triton_ok = device.type == "cuda" and dispatch.triton_unavailable_reason() is None and not dispatch.interpreting()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    repeats = args.repeats or (10 if device.type == "cuda" else 3)
    if args.quick:
        lp_shapes, gae_shapes = [(256, 32000), (1024, 32000)], [(16, 512), (64, 1024)]
    else:
        lp_shapes = [(n, v) for n in (4096, 16384) for v in (32000, 151936)]
        gae_shapes = [(b, t) for b in (64, 512) for t in (512, 4096)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {name}; torch {torch.__version__}; logits dtype {args.dtype}")
    if not triton_ok:
        print("No CUDA device (or Triton unavailable): timing the torch paths only; the Triton rows say n/a.")
    bandwidth = measure_bandwidth(device)
    print(f"measured memory bandwidth (large copy): {bandwidth / 1e9:.1f} GB/s")
    lp_impls, kl_impls, gae_impls = implementations(device, triton_ok)
    ops = set(args.ops.split(","))
    results = []
    elt = torch.finfo(dtype).bits // 8
    budget = available_bytes(device)

    for n_rows, n_cols in lp_shapes:
        # the naive paths hold an fp32 upcast and a log-softmax (and exp) of the logits
        need = n_rows * n_cols * (2 * elt + 4 * 4)
        if need > 0.8 * budget:
            print(f"\nskipping N={n_rows}, V={n_cols}: needs ~{need / 2**30:.1f} GiB, {budget / 2**30:.1f} GiB free")
            continue
        logits = (torch.randn(n_rows, n_cols, device=device) * 3).to(dtype)
        labels = torch.randint(0, n_cols, (n_rows,), device=device)
        if "logprob" in ops:
            run_case(f"logprob+entropy fwd  N={n_rows} V={n_cols} {args.dtype}", lp_impls, (logits, labels),
                     n_rows * n_cols * elt, naive_logprob_entropy, device, bandwidth, repeats, results)
            if args.backward:
                run_case(f"logprob+entropy fwd+bwd  N={n_rows} V={n_cols} {args.dtype}",
                         {k: v for k, v in lp_impls.items() if k in BOTH_OUTPUTS}, (logits, labels),
                         3 * n_rows * n_cols * elt, lambda z, y: _fwd_bwd(naive_logprob_entropy, (z, y)), device,
                         bandwidth, repeats, results, backward=True)
        if "symkl" in ops:
            ref_logits = (logits.float() + torch.randn_like(logits, dtype=torch.float32)).to(dtype)
            run_case(f"symmetric KL fwd  N={n_rows} V={n_cols} {args.dtype}", kl_impls, (logits, ref_logits),
                     2 * n_rows * n_cols * elt, naive_symkl, device, bandwidth, repeats, results)
            if args.backward:
                run_case(f"symmetric KL fwd+bwd  N={n_rows} V={n_cols} {args.dtype}", kl_impls, (logits, ref_logits),
                         5 * n_rows * n_cols * elt, lambda z, r: _fwd_bwd(naive_symkl, (z, r)), device, bandwidth,
                         repeats, results, backward=True)
            del ref_logits
        if args.sweep and triton_ok:
            sweep_logprob(logits, labels, device, bandwidth)
        del logits, labels
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if "gae" in ops:
        for n_rows, n_steps in gae_shapes:
            rewards = torch.randn(n_rows, n_steps, device=device)
            values = torch.randn(n_rows, n_steps, device=device)
            lengths = torch.randint(1, n_steps + 1, (n_rows,), device=device)
            mask = torch.arange(n_steps, device=device)[None] < lengths[:, None]
            run_case(f"masked GAE  B={n_rows} T={n_steps}", gae_impls, (rewards, values, mask, 0.99, 0.95),
                     n_rows * n_steps * (4 + 4 + 1 + 4 + 4), naive_gae, device, bandwidth,
                     min(repeats, 3) if device.type == "cpu" else repeats, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, bandwidth_gbps=bandwidth / 1e9, dtype=args.dtype, results=results), f, indent=1)
    return 0


def sweep_logprob(logits, labels, device, bandwidth):
    """Time the log-prob forward over launch shapes, to tune _utils.vocab_meta on a new GPU."""
    from verl_ds.kernels import _utils
    from verl_ds.kernels.logprob import logprobs_and_entropy
    n_rows, n_cols = logits.shape
    bytes_moved = n_rows * n_cols * logits.element_size()
    print(f"  sweep (BLOCK_V, num_warps) for the log-prob forward, N={n_rows} V={n_cols}:")
    try:
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                if block // (32 * warps) < 1:
                    continue
                _utils.VOCAB_LAUNCH_OVERRIDE = {"BLOCK_V": block, "num_warps": warps}
                seconds = median_time(lambda: logprobs_and_entropy(logits, labels), device, 5)
                gbps = bytes_moved / seconds / 1e9
                print(f"    BLOCK_V={block:5d} num_warps={warps:2d}: {seconds * 1e3:8.3f} ms "
                      f"{gbps:7.1f} GB/s ({100 * gbps * 1e9 / bandwidth:.0f}%)")
    finally:
        _utils.VOCAB_LAUNCH_OVERRIDE = None


if __name__ == "__main__":
    sys.exit(main())
