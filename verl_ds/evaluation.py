"""Evaluation on the held-out prompts: greedy score, and with ``trainer.val_n`` > 1 sampled mean@n and pass@k, the
unbiased estimator 1 - C(n - c, k) / C(n, k) of Chen et al. 2021 (arXiv:2107.03374, eq. 1) for c of n samples correct
(scoring at least ``trainer.val_pass_threshold``)."""
from __future__ import annotations

import torch

from verl_ds import dist as vdist


@torch.no_grad()
def evaluate(run, val_set) -> dict:
    """``val/score/mean`` and, with ``trainer.val_n`` > 1, ``val/mean@n``, ``val/pass@1``, ``val/pass@n`` over every
    rank's share of ``val_set`` (equal shares: generation may be a collective); ``run``: a ``RolloutRun``."""
    from verl_ds.algos import pass_at_k
    from verl_ds.data import collate_prompts

    if val_set is None:
        return {}
    cfg, tok, world = run.cfg, run.tokenizer, vdist.world_size()
    hot = run.state.snapshot()
    idx = list(range(run.rank, (len(val_set) // world) * world, world))
    per_call = run.sampler.batch_size  # the prompts of one rank's step
    actor, reward = run.registry.get("actor"), run.registry.get("reward")
    n = cfg.trainer.val_n
    sums = torch.zeros(5, dtype=torch.float64)  # greedy score sum, prompts, sampled score sum, pass@1, pass@n
    for i in range(0, len(idx), per_call):
        items = [val_set[j] for j in idx[i:i + per_call]]
        prompts = collate_prompts(items, tok.pad_token_id, run.device)
        greedy = run.rollout_fn(actor, reward, tok, prompts, max_new_tokens=hot["max_new_tokens"], greedy=True)
        sums[0] += greedy.batch.scores.sum().item()
        sums[1] += len(items)
        if n > 1:
            sampled = run.rollout_fn(actor, reward, tok, prompts, max_new_tokens=hot["max_new_tokens"],
                                     temperature=hot["temperature"], top_k=hot["top_k"], top_p=hot["top_p"], n=n)
            scores = sampled.batch.scores.sum(-1).view(len(items), n).double().cpu()
            correct = (scores >= cfg.trainer.val_pass_threshold).sum(-1).tolist()
            sums[2] += scores.sum()
            sums[3] += sum(pass_at_k(n, c, 1) for c in correct)
            sums[4] += sum(pass_at_k(n, c, n) for c in correct)
    total = vdist.all_reduce_sum(sums).tolist()
    prompts_seen = max(total[1], 1.0)
    out = {"val/score/mean": total[0] / prompts_seen}
    if n > 1:
        out.update({f"val/mean@{n}": total[2] / (prompts_seen * n), "val/pass@1": total[3] / prompts_seen,
                    f"val/pass@{n}": total[4] / prompts_seen})
    return out
