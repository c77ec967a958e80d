"""The figures of ``benchmarks/e2e_vs_trl.py`` from the rows of its runs: the per-side summary (s/step, tokens/s,
scores, the profile of a typical step), the float32 GEMM rate of this machine and the arithmetic floor of a step."""
from __future__ import annotations

import math
import statistics
import time

from e2e_vs_trl_sides import PHASES  # registered by e2e_vs_trl._sibling


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
    (``model.share_prompts`` and ``rollout.share``) the generation's prefill, the reference and the update
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


def _profile(name: str, prof: dict) -> str:
    step = prof["step_s"]
    phases = {p: prof[p] for p in PHASES if prof[p] > 0}
    other = step - sum(phases.values())
    parts = [f"{p} {v * 1000:.0f} ms ({100 * v / step:.0f}%)" for p, v in sorted(phases.items(), key=lambda kv: -kv[1])]
    return f"  {name}: step {step * 1000:.0f} ms = " + ", ".join(parts) + f", untimed {other * 1000:.0f} ms"
