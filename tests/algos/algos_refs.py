"""Slow, obviously-correct float64 references for the verl_ds.algos tests (plain Python loops)."""
import math

import torch


def logprob_entropy_loop(logits, labels, temperature=1.0):
    """Per row: log-sum-exp by max-shift in float64, then log p_y and -sum p log p. Returns float64 (N,)."""
    x = logits.detach().to(torch.float64).reshape(-1, logits.shape[-1]) / temperature
    y = labels.reshape(-1)
    lp, ent = [], []
    for i in range(x.shape[0]):
        row = x[i].tolist()
        m = max(row)
        s = sum(math.exp(v - m) for v in row)
        lse = m + math.log(s)
        lp.append(row[int(y[i])] - lse)
        ent.append(-sum(math.exp(v - lse) * (v - lse) for v in row))
    shape = labels.shape
    return (torch.tensor(lp, dtype=torch.float64).view(shape), torch.tensor(ent, dtype=torch.float64).view(shape))


def naive_logprob_entropy(logits, labels, temperature=1.0):
    """The naive autograd formula (full log_softmax), in the logits' float64 twin."""
    ls = torch.log_softmax(logits / temperature, dim=-1)
    lp = ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return lp, ent


def symmetric_kl_loop(logits, ref_logits, temperature=1.0):
    """0.5 * (KL(p||q) + KL(q||p)) per row from the definition, float64."""
    x = logits.detach().to(torch.float64).reshape(-1, logits.shape[-1]) / temperature
    y = ref_logits.detach().to(torch.float64).reshape(-1, logits.shape[-1]) / temperature
    out = []
    for i in range(x.shape[0]):
        lp = torch.log_softmax(x[i], -1).tolist()
        lq = torch.log_softmax(y[i], -1).tolist()
        kl_pq = sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))
        kl_qp = sum(math.exp(b) * (b - a) for a, b in zip(lp, lq))
        out.append(0.5 * (kl_pq + kl_qp))
    return torch.tensor(out, dtype=torch.float64).view(logits.shape[:-1])


def gae_loop(rewards, values, mask, gamma, lam):
    """verl's per-step reverse walk, one row and one step at a time, float64."""
    b, t = rewards.shape
    adv = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        next_value, gae = 0.0, 0.0
        for s in reversed(range(t)):
            if bool(mask[i, s]):
                gae = float(rewards[i, s]) + gamma * next_value - float(values[i, s]) + gamma * lam * gae
                next_value = float(values[i, s])
            adv[i, s] = gae
    return adv, adv + values.to(torch.float64)


def verl_gae_vectorized_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (before whitening): a loop over t, vectorised over rows."""
    mask = mask.to(rewards.dtype)
    next_values = torch.zeros_like(rewards[:, 0])
    last = torch.zeros_like(rewards[:, 0])
    out = []
    for s in reversed(range(rewards.shape[1])):
        delta = rewards[:, s] + gamma * next_values - values[:, s]
        cand = delta + gamma * lam * last
        next_values = values[:, s] * mask[:, s] + (1 - mask[:, s]) * next_values
        last = cand * mask[:, s] + (1 - mask[:, s]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def masked_stats_loop(x, mask):
    """(mean, unbiased var) over the valid elements, from a Python list."""
    vals = [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else float("nan")
    return mean, var


def ppo_token_loss(logprob, old_logprob, adv, low, high, c):
    """The clipped surrogate with dual clip for one token, from the definition (Ye et al. 2019, arXiv:1912.09729)."""
    log_ratio = min(max(logprob - old_logprob, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * min(max(ratio, 1 - low), 1 + high)
    clipped = max(l1, l2)
    if c is not None and adv < 0:
        return min(clipped, -c * adv), l2 > l1, clipped > -c * adv
    return clipped, l2 > l1, False


# --- critic-free advantage estimators: one sample at a time, Python floats (float64) ----------------

def _scores_and_groups(rewards, mask, ids):
    """Per sample: the sum of its rewards over the response; per id: the list of sample indices."""
    scores = [sum(float(r) for r, m in zip(row, mrow) if m) for row, mrow in zip(rewards.tolist(), mask.tolist())]
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return scores, groups


def _broadcast(values, mask):
    """values[i] on every response token of row i, 0 elsewhere (float64 tensor)."""
    return torch.tensor([[v if m else 0.0 for m in mrow] for v, mrow in zip(values, mask.tolist())],
                        dtype=torch.float64).view(mask.shape)


def grpo_loop(rewards, mask, ids, eps=1e-6, norm_by_std=True):
    """GRPO/Dr.GRPO from the definition: statistics.mean/stdev per group; a group of one: mean 0, std 1."""
    import statistics
    scores, groups = _scores_and_groups(rewards, mask, ids)
    adv = [0.0] * len(scores)
    for members in groups.values():
        vals = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.mean(vals), statistics.stdev(vals))
        for i in members:
            adv[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return _broadcast(adv, mask)


def rloo_loop(rewards, mask, ids):
    """Score minus the mean of the other samples of the group (0 baseline for a group of one)."""
    scores, groups = _scores_and_groups(rewards, mask, ids)
    adv = [0.0] * len(scores)
    for members in groups.values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            adv[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return _broadcast(adv, mask)


def _whiten_loop(x, mask, eps):
    vals = [v for row, mrow in zip(x.tolist(), mask.tolist()) for v, m in zip(row, mrow) if m]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return torch.tensor([[(v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(row, mrow)]
                         for row, mrow in zip(x.tolist(), mask.tolist())], dtype=torch.float64).view(x.shape)


def reinforce_pp_loop(rewards, mask, gamma):
    """verl's REINFORCE++ one token at a time, as fixed in verl-project/verl#7300: a valid token sets
    G = r_t + gamma * G and returns it; a masked token (a tool's observation, padding) returns 0 and passes
    G on unchanged (no discount across it); advantages whitened (eps 1e-8) over the valid tokens."""
    rows = []
    for row, mrow in zip(rewards.tolist(), mask.tolist()):
        out, running = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            if mrow[t]:
                running = row[t] + gamma * running
                out[t] = running
        rows.append(out)
    returns = torch.tensor(rows, dtype=torch.float64).view(rewards.shape)
    return _whiten_loop(returns, mask, 1e-8), returns


def reinforce_pp_baseline_loop(rewards, mask, ids):
    """Score minus group mean (0 for a group of one) on each response token, whitened over the tokens with verl's
    masked_whiten epsilon 1e-8 (verl's estimator takes an ``epsilon`` it never uses)."""
    scores, groups = _scores_and_groups(rewards, mask, ids)
    centered = [0.0] * len(scores)
    for members in groups.values():
        mean = 0.0 if len(members) == 1 else sum(scores[i] for i in members) / len(members)
        for i in members:
            centered[i] = scores[i] - mean
    return _whiten_loop(_broadcast(centered, mask), mask, 1e-8)


def remax_loop(rewards, mask, baselines):
    """G_t = sum of the valid rewards at t' >= t; advantages G_t - b on valid tokens. Returns (adv, returns)."""
    adv, ret = [], []
    for row, mrow, b in zip(rewards.tolist(), mask.tolist(), baselines.tolist()):
        g = [sum(row[s] for s in range(t, len(row)) if mrow[s]) for t in range(len(row))]
        ret.append([gt if m else 0.0 for gt, m in zip(g, mrow)])
        adv.append([gt - b if m else 0.0 for gt, m in zip(g, mrow)])
    return (torch.tensor(adv, dtype=torch.float64).view(rewards.shape),
            torch.tensor(ret, dtype=torch.float64).view(rewards.shape))
