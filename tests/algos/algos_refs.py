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
