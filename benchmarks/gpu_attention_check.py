"""Packed-row attention layouts against each sequence run alone, per ``model.attn_implementation``.

For each implementation (``--impls``; the per-sequence loop ``--loop`` first, as the baseline) a small Qwen2 is built
from config the way the trainer builds it (``verl_ds.engines.build.build_actor_model`` with the key set, then
``verl_ds.models.families.packing_support``, the start-up probe that readies a model for packed rows), and a batch
of prompt groups is scored in three layouts (``--layouts``): plain packing (``verl_ds.packing.pack``), shared prompts
and shared response prefixes (``verl_ds.prompt_sharing.pack_shared_prompts``), through
``verl_ds.models.packed_forward.packed_logprobs``. The reference is the same weights with transformers' ``sdpa``
on each sequence alone, unpadded, in the same dtype. Per (implementation, layout) it prints the largest log-prob and
entropy differences over the real response tokens, the relative L2 difference of the gradients of the summed
log-probs, and the time of one forward + backward against the loop's. A leak control (the plain packed row attended
as one causal sequence) shows how far a wrong layout lands, so a pass means something at the dtype's tolerance.

An implementation that is asked for but not the one the model runs after the probe (``config._attn_implementation``)
fails its rows, as does a layout the probe refuses: nothing falls back silently. ``model.attn_implementation`` must
be a config key of this tree (issue 32's attention path); without it the script exits 2 saying so.

    python benchmarks/gpu_attention_check.py --json out.json       # CUDA, bf16, the check's sizes
    python benchmarks/gpu_attention_check.py --device cpu --tiny    # fp32, a few tokens (flash/Flex skipped)

Last line: ``gpu_attention_check ok=<0|1> worst_mean_logprob_diff=<x> leak_mean_logprob_diff=<y>
<impl>_<layout>_time_ratio=<t>...`` (time ratios against the loop).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # verl_ds from this checkout

import torch  # noqa: E402

LOOP = "sdpa"  # packed rows then run one sdpa call per sequence or prompt group per layer (attention_layout.packed_attention)
LAYOUTS = ("plain", "shared_prompts", "shared_prefixes")
# (groups, samples per group, prompt lengths, response lengths, hidden, layers, heads, kv heads)
SIZES = {"tiny": dict(groups=2, n=2, prompt=(3, 6), response=(2, 7), hidden=32, layers=2, heads=4, kv_heads=2),
         "check": dict(groups=4, n=4, prompt=(64, 200), response=(96, 400), hidden=256, layers=2, heads=4,
                       kv_heads=2)}
# limits per dtype: the mean and largest |log-prob| difference over the real response tokens, the largest |entropy|
# one, the gradients' relative L2 difference. In bf16 the loop itself lands at means of 2e-4 to 1.5e-2 and maxima of
# 0.07-0.19 at the check's size (on a CPU), a lost layout at a mean of 3.3 (the leak control, which must reach 10x
# the mean limit for a pass to mean anything)
TOL = {"fp32": {"logprob_mean": 1e-5, "logprob": 1e-4, "entropy": 1e-4, "grad_rel": 1e-3},
       "bf16": {"logprob_mean": 5e-2, "logprob": 0.5, "entropy": 0.5, "grad_rel": 0.1}}


def config_error(impl: str) -> str | None:
    """Why ``model.attn_implementation=<impl>`` is refused by this tree's config, or None."""
    from verl_ds.config import load_config
    from verl_ds.config.fields import ConfigError

    try:
        load_config(overrides=[f"model.attn_implementation={impl}"])
    except ConfigError as exc:
        return str(exc)
    return None


def skip_reason(impl: str, device: str) -> str | None:
    """Why ``impl`` cannot run on ``device`` here, or None."""
    if impl == "flash_attention_2":
        if device != "cuda":
            return "flash_attention_2 needs CUDA"
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            return f"flash_attn does not import ({exc})"
    if impl == "flex_attention" and device != "cuda":
        return "flex_attention on a CPU compiles through inductor (minutes on a small machine); name it in --impls"
    return None


def build(impl: str, size: dict, dtype: str, device: str, vocab: int, max_length: int, std: float):
    """(model, packing support) for ``model.attn_implementation=<impl>``, built and probed as the trainer does; Linear
    and embedding weights drawn with std ``std`` so that which tokens attend to which moves the log-probs well past
    the dtype's rounding."""
    from verl_ds.attention_layout import resolve_attn_implementation
    from verl_ds.config import load_config
    from verl_ds.engines.build import build_actor_model
    from verl_ds.models.families import packing_support
    from verl_ds.tokenizer import build_tokenizer

    overrides = ["model.arch=qwen2", f"model.config_overrides.hidden_size={size['hidden']}",
                 f"model.config_overrides.intermediate_size={2 * size['hidden']}", f"model.config_overrides.num_hidden_layers={size['layers']}",
                 f"model.config_overrides.num_attention_heads={size['heads']}", f"model.config_overrides.num_key_value_heads={size['kv_heads']}",
                 f"model.config_overrides.max_position_embeddings={max_length}", f"model.dtype={dtype}",
                 f"trainer.device={device}"]
    if impl is not None:
        overrides.append(f"model.attn_implementation={impl}")
    cfg = load_config(overrides=overrides)
    tok = build_tokenizer([f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(vocab - 4)])
    model = build_actor_model(cfg, tok)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.mul_(std / model.config.initializer_range)
    model = model.to(device)
    # the implementation the trainer would pack rows with (builder.packing_decision): without it the probe switches
    # the model to the per-sequence loop whatever was asked
    implementation = resolve_attn_implementation(cfg.model.attn_implementation, torch.device(device).type)
    support = packing_support(model, max_length, share=True, implementation=implementation)
    return model, support


def make_batch(size: dict, vocab: int, device: str, prefixes: bool, seed: int = 0):
    """(observation (B, P + R), mask (B, P + R) bool, R): ``groups`` prompts of ``n`` samples each, prompts left-padded
    to P and the same in every row of a group, responses right-padded to R with lengths drawn in ``response``; with
    ``prefixes`` the samples of a group share leading response tokens (sample j > 0 repeats the first 3/4, 1/2, ...
    of sample 0's response, then goes its own way)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = size["prompt"]
    rlo, rhi = size["response"]
    P, R, B = hi, rhi, size["groups"] * size["n"]
    obs = torch.randint(4, vocab, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    for grp in range(size["groups"]):
        plen = int(torch.randint(lo, hi + 1, (1,), generator=g))
        rows = range(grp * size["n"], (grp + 1) * size["n"])
        for j, b in enumerate(rows):
            obs[b, :P] = obs[rows[0], :P]
            mask[b, P - plen:P] = True
            rlen = int(torch.randint(rlo, rhi + 1, (1,), generator=g))
            mask[b, P:P + rlen] = True
            if prefixes and j:
                keep = min(rlen - 1, int(mask[rows[0], P:].sum()) * (size["n"] - j) // size["n"])
                obs[b, P:P + keep] = obs[rows[0], P:P + keep]
    return torch.where(mask, obs, 0).to(device), mask.to(device), R


def per_sequence(ref, obs, mask, R):
    """Log-probs and entropies (B, R) float32 of the real response tokens, each sequence alone (no padding)."""
    B, T = obs.shape
    lp = torch.zeros(B, R, device=obs.device)
    ent = torch.zeros(B, R, device=obs.device)
    for b in range(B):
        cols = mask[b].nonzero().flatten()
        ids = obs[b, cols].unsqueeze(0)
        resp = (cols >= T - R).nonzero().flatten()
        logits = ref(input_ids=ids, use_cache=False).logits[0, resp - 1].float()
        ls = torch.log_softmax(logits, -1)
        lp[b, cols[resp] - (T - R)] = ls.gather(-1, ids[0, resp].unsqueeze(-1)).squeeze(-1)
        ent[b, cols[resp] - (T - R)] = -(ls.exp() * ls).sum(-1)
    return lp, ent


def packed(model, obs, mask, R, layout: str):
    """Log-probs and entropies (B, R) of the batch packed in ``layout``, as the trainer scores it."""
    from verl_ds.models.packed_forward import packed_logprobs
    from verl_ds.packing import pack
    from verl_ds.prompt_sharing import pack_shared_prompts

    if layout == "plain":
        rows = pack(obs, mask, R)
    else:
        rows = pack_shared_prompts(obs, mask, R, share_prefixes=layout == "shared_prefixes")
    return packed_logprobs(model, rows, R, compute_entropy=True)


def leak(ref, obs, mask, R):
    """The plain packed row attended as one causal sequence (what a lost layout computes): its log-probs (B, R)."""
    from verl_ds.packing import pack

    rows = pack(obs, mask, R)
    n = rows.input_ids.shape[1]
    logits = ref(input_ids=rows.input_ids, position_ids=torch.arange(n, device=obs.device)[None],
                 use_cache=False).logits[0].float()
    t = rows.targets
    lp = torch.log_softmax(logits[t.preds], -1).gather(-1, t.label_ids[:, None]).squeeze(-1)
    return torch.zeros(obs.shape[0] * R, device=obs.device).index_copy(0, t.out, lp).view(-1, R)


def _grads(model) -> dict:
    return {k: p.grad.detach().float().clone() for k, p in model.named_parameters() if p.grad is not None}


def compare(model, ref, obs, mask, R, layout: str) -> dict:
    """Largest |log-prob| and |entropy| differences over the real response tokens and the gradients' relative L2
    difference (of the summed log-probs), ``model`` in ``layout`` against ``ref`` on each sequence alone."""
    real = mask[:, -R:]
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    lp, ent = packed(model, obs, mask, R, layout)
    (lp * real).sum().backward()
    want_lp, want_ent = per_sequence(ref, obs, mask, R)
    (want_lp * real).sum().backward()
    got, want = _grads(model), _grads(ref)
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    den = sum(float(want[k].pow(2).sum()) for k in want)
    lp, ent, want_lp, want_ent = lp.detach(), ent.detach(), want_lp.detach(), want_ent.detach()
    d = (lp - want_lp).abs() * real
    return {"logprob": float(d.max()), "logprob_mean": float(d.sum() / real.sum()),
            "entropy": float(((ent - want_ent).abs() * real).max()), "grad_rel": (num / max(den, 1e-30)) ** 0.5}


def time_step(model, obs, mask, R, layout: str, reps: int) -> float:
    """Median seconds of one forward + backward of the packed batch (after one untimed call)."""
    real = mask[:, -R:]
    times = []
    for i in range(reps + 1):
        if obs.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lp, _ = packed(model, obs, mask, R, layout)
        (lp * real).sum().backward()
        if obs.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def run(a) -> int:
    size = SIZES["tiny" if a.tiny else "check"]
    dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    layouts = [x for x in a.layouts.split(",") if x]
    impls = [a.loop] + [x for x in a.impls.split(",") if x and x != a.loop]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        print(f"gpu_attention_check: --layouts must name layouts from {LAYOUTS}; got {bad}", file=sys.stderr)
        return 2
    skipped = {i: skip_reason(i, a.device) for i in impls}
    for impl, why in skipped.items():
        if why:
            print(f"attention {impl}: skipped ({why})", flush=True)
    impls = [i for i in impls if not skipped[i]]
    refused = {i: config_error(i) for i in impls}
    if any("unknown config key 'model.attn_implementation'" in (e or "") for e in refused.values()):
        print("gpu_attention_check: model.attn_implementation is not a config key of this verl_ds tree (issue 32's "
              "attention path has not landed here), so no implementation can be chosen; nothing was checked",
              file=sys.stderr)
        return 2
    for impl, why in refused.items():
        if why:
            print(f"gpu_attention_check: model.attn_implementation={impl} is refused: {why}", file=sys.stderr)
            return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_attention_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    vocab, max_length = 512, size["prompt"][1] + size["response"][1] + 8
    torch.manual_seed(0)
    batches = {layout: make_batch(size, vocab, a.device, layout == "shared_prefixes") for layout in layouts}
    print(f"gpu_attention_check: {a.device}, {dtype}, Qwen2 hidden {size['hidden']}, {size['layers']} layers, "
          f"{size['heads']} heads ({size['kv_heads']} KV), {size['groups']} prompts x {size['n']} samples, prompts "
          f"{size['prompt'][0]}-{size['prompt'][1]} and responses {size['response'][0]}-{size['response'][1]} tokens; "
          f"implementations {impls}, layouts {layouts}", flush=True)
    report, ok, base_time, worst = {"rows": []}, True, {}, 0.0
    for impl in impls:
        try:
            model, support = build(impl, size, dtype, a.device, vocab, max_length, a.init_std)
        except Exception as exc:  # noqa: BLE001 - one implementation that cannot be built fails its rows only
            why = f"building the model raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"  {impl:20s} FAIL: {why}", flush=True)
            report["rows"] += [{"impl": impl, "layout": layout, "ok": False, "why": why} for layout in layouts]
            ok = False
            if impl == impls[0]:
                break  # no reference without the baseline's weights
            continue
        from verl_ds.attention_layout import packed_attention

        ran = getattr(model.config, "_attn_implementation", None)
        if impl == impls[0]:
            from transformers import AutoModelForCausalLM

            # a copy of the config: from_config would set the attention of the checked model's own config too
            ref = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
            ref.load_state_dict(model.state_dict())
            ref = ref.to(device=a.device, dtype=next(model.parameters()).dtype)
            with torch.no_grad():
                obs, mask, R = batches[layouts[0]]
                real = mask[:, -R:]
                leak_diff = float(((leak(ref, obs, mask, R) - per_sequence(ref, obs, mask, R)[0]).abs() * real).sum()
                                  / real.sum())
            report["leak_diff"] = leak_diff
            print(f"  leak control (the packed row as one sequence): mean |d log-prob| {leak_diff:.3g}", flush=True)
            if leak_diff < 10 * TOL[dtype]["logprob_mean"]:
                print(f"  FAIL: a lost layout moves the log-probs by {leak_diff:.3g} on average, under 10x the limit "
                      f"{TOL[dtype]['logprob_mean']}: raise --init-std", flush=True)
                ok = False
        for layout in layouts:
            refused_by = support.packing if layout == "plain" else support.sharing
            row = {"impl": impl, "runs": ran, "layout": layout}
            # what the model should run for the name asked (sdpa and eager: our per-tree sdpa; flash: Flex for a tree)
            serves = {impl} | {packed_attention(impl, shared, a.device)[0] for shared in (False, True)}
            if refused_by or (impl != "auto" and ran not in serves):
                why = refused_by or f"asked {impl}, the model runs {ran}"
                print(f"  {impl:20s} {layout:16s} FAIL: {why}", flush=True)
                report["rows"].append({**row, "ok": False, "why": why})
                ok = False
                continue
            obs, mask, R = batches[layout]
            try:
                diff = compare(model, ref, obs, mask, R, layout)
                seconds = time_step(model, obs, mask, R, layout, a.reps)
            except Exception as exc:  # noqa: BLE001 - e.g. PackedRowNotReached: this row fails, the others run
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(f"  {impl:20s} {layout:16s} FAIL: {why}", flush=True)
                report["rows"].append({**row, "ok": False, "why": why})
                ok = False
                continue
            base_time.setdefault(layout, seconds)
            good = all(diff[k] <= limit for k, limit in TOL[dtype].items())
            worst = max(worst, diff["logprob_mean"])
            ok &= good
            ratio = seconds / base_time[layout]
            report["rows"].append({**row, **diff, "seconds": seconds, "time_ratio": ratio, "ok": good})
            print(f"  {impl:20s} {layout:16s} runs {ran}: |d log-prob| mean {diff['logprob_mean']:.2e} max "
                  f"{diff['logprob']:.2e}, max |d entropy| "
                  f"{diff['entropy']:.2e}, grad rel {diff['grad_rel']:.2e}; fwd+bwd {seconds * 1e3:.1f} ms "
                  f"({ratio:.2f} x {impls[0]}) {'ok' if good else 'FAIL'}", flush=True)
        del model
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({**report, "ok": ok, "device": a.device, "dtype": dtype}, fh, indent=1)
    ratios = " ".join(f"{r['impl']}_{r['layout']}_time_ratio={r['time_ratio']:.3f}" for r in report["rows"]
                      if "time_ratio" in r and r["impl"] != impls[0])
    print(f"gpu_attention_check ok={int(ok)} worst_mean_logprob_diff={worst:.3g} "
          f"leak_mean_logprob_diff={report.get('leak_diff', 0):.3g}"
          + (f" {ratios}" if ratios else ""))
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a few tokens per sequence (the CPU smoke size)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--loop", default=LOOP, help="the model.attn_implementation of the per-sequence loop (baseline)")
    p.add_argument("--impls", default="auto,flash_attention_2,flex_attention",
                   help="comma-separated model.attn_implementation values to check after the loop")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    p.add_argument("--init-std", type=float, default=0.2, help="std of the Linear and embedding weights")
    p.add_argument("--reps", type=int, default=3, help="timed forward + backward calls per row")
    p.add_argument("--json", default=None, help="write the rows here")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
