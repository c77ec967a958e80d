"""Token-budget micro-batches: the budget holds, every sample once, the agreed count on every rank (2 real gloo
ranks), better balance than sequential filling, deterministic; with variable micro-batches the summed
token-sum losses over the global token count are the full-batch token mean, loss and gradients."""
import json
import os
import random
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from verl_ds.algos import logprobs_from_logits, policy_loss, value_loss
from verl_ds.packing import agree_num_micro_batches, count_micro_batches, token_budget_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sequential(lengths, budget):
    """The greedy baseline: fill micro-batches in sample order, start a new one when the next sample
    would overflow the budget."""
    out, load = [[]], 0
    for i, n in enumerate(lengths):
        if out[-1] and load + n > budget:
            out.append([])
            load = 0
        out[-1].append(i)
        load += n
    return out


def _check_partition(parts, lengths, budget, k):
    assert len(parts) == k and all(parts)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # every sample exactly once
    for p in parts:
        assert sum(lengths[i] for i in p) <= budget or len(p) == 1


def test_properties_on_random_cases():
    rng = random.Random(0)
    for case in range(300):
        n = rng.randint(1, 40)
        budget = rng.randint(5, 200)
        lengths = [rng.randint(1, int(budget * rng.choice([0.3, 0.8, 1.5]))) for _ in range(n)]
        need = count_micro_batches(lengths, budget)
        assert need >= -(-sum(min(x, budget) for x in lengths) // budget)  # at least the volume bound
        for k in range(need, min(n, need + 3) + 1):
            parts = token_budget_micro_batches(lengths, budget, k)
            _check_partition(parts, lengths, budget, k)
            assert parts == token_budget_micro_batches(list(lengths), budget, k)  # deterministic
            assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)


def test_hand_cases():
    # least-loaded first would put 3 + 3 on top of 4 + 4 and overflow: the first-fit-decreasing packing is used
    assert token_budget_micro_batches([6, 4, 4, 3, 3], 10) == [[0, 1], [2, 3, 4]]
    # one sample over the budget travels alone; the rest are balanced around it
    parts = token_budget_micro_batches([50, 3, 3, 3, 3], 10, 3)
    assert parts == [[0], [1, 3], [2, 4]]  # equal samples alternate between the two light micro-batches
    assert count_micro_batches([50, 3, 3, 3, 3], 10) == 3 and count_micro_batches([50, 3, 3, 3], 10) == 2
    assert token_budget_micro_batches(torch.tensor([5, 5, 5, 5]), 10, 4) == [[0], [1], [2], [3]]


def test_more_balanced_than_sequential_filling():
    rng = random.Random(1)
    spread, base_spread = [], []
    for _ in range(50):
        lengths = [rng.randint(1, 128) + 16 for _ in range(64)]  # prompt + uniform response lengths
        budget = 1024
        ours = token_budget_micro_batches(lengths, budget)
        base = _sequential(lengths, budget)
        loads = [sum(lengths[i] for i in p) for p in ours]
        base_loads = [sum(lengths[i] for i in p) for p in base]
        assert len(ours) <= len(base)
        assert max(loads) - min(loads) <= max(base_loads) - min(base_loads)
        spread.append(max(loads) - min(loads))
        base_spread.append(max(base_loads) - min(base_loads))
    assert sum(spread) <= 0.1 * sum(base_spread)  # sequential filling leaves its last micro-batch light
    assert max(spread) <= 0.1 * 1024


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"num_micro_batches=1 is too few: .* need 2 micro-batches of at most 10"):
        token_budget_micro_batches([6, 6], 10, 1)
    with pytest.raises(ValueError, match="num_micro_batches=3 exceeds the 2 samples"):
        token_budget_micro_batches([6, 6], 10, 3)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a positive int .* got 0"):
        count_micro_batches([3, 0], 10)
    with pytest.raises(ValueError, match="max_tokens .* must be a positive int, got 0"):
        count_micro_batches([3], 0)
    with pytest.raises(ValueError, match="lengths is empty"):
        count_micro_batches([], 4)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        count_micro_batches(torch.tensor([1.0, 2.0]), 4)
    with pytest.raises(ValueError, match="local_count must be a positive int"):
        agree_num_micro_batches(0)
    assert agree_num_micro_batches(3) == 3  # no process group: the local count


WORKER = r'''
import json, sys, datetime
import torch.distributed as dist
from verl_ds.packing import agree_num_micro_batches, count_micro_batches, token_budget_micro_batches

rank = int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
# rank 0: short samples (2 micro-batches of 100 tokens); rank 1: long ones (5)
lengths = [30, 20, 25, 10, 40, 15] if rank == 0 else [90, 80, 60, 70, 50, 40]
local = count_micro_batches(lengths, 100)
k = agree_num_micro_batches(local)
parts = token_budget_micro_batches(lengths, 100, k)
dist.barrier()
with open(sys.argv[1], "w") as f:
    json.dump({"local": local, "k": k, "parts": parts}, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_ranks_agree_on_the_count_with_two_gloo_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT}
        procs = [subprocess.Popen([sys.executable, script, os.path.join(tmp, f"{r}.json"), str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
        out = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2)]
    assert [o["local"] for o in out] == [2, 5]
    assert [o["k"] for o in out] == [5, 5] and [len(o["parts"]) for o in out] == [5, 5]
    lengths0 = [30, 20, 25, 10, 40, 15]
    _check_partition(out[0]["parts"], lengths0, 100, 5)


def _ppo_inputs(B=6, R=7, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, R, V, generator=g, dtype=torch.float64).float().requires_grad_()
    actions = torch.randint(0, V, (B, R), generator=g)
    lengths = torch.tensor([7, 1, 2, 1, 1, 3])
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)
    old = torch.randn(B, R, generator=g) * 0.1 - 2.4
    adv, ret = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    return logits, actions, mask, old, adv, ret


def _losses(logits, actions, mask, old, adv, ret, rows, normalizer=None):
    lp = logprobs_from_logits(logits[rows], actions[rows])
    pl, _ = policy_loss(lp, old[rows], adv[rows], mask[rows], loss_agg_mode="token-mean", normalizer=normalizer)
    values = lp.detach() * 0 + logits[rows, :, 0]  # any differentiable per-token values
    vl, _ = value_loss(values, old[rows], ret[rows], mask[rows], loss_agg_mode="token-mean", normalizer=normalizer)
    return pl + vl


def test_variable_micro_batches_keep_the_exact_global_token_mean():
    logits, actions, mask, old, adv, ret = _ppo_inputs()
    full = _losses(logits, actions, mask, old, adv, ret, list(range(6)))
    (g_full,) = torch.autograd.grad(full, logits)
    tokens = mask.sum(1).tolist()
    G = sum(tokens)
    parts = token_budget_micro_batches(tokens, 7)
    assert len({len(p) for p in parts}) > 1  # micro-batches of different sizes
    # each micro-batch's token sum over the global count G; their sum is the full-batch token mean
    summed = sum(_losses(logits, actions, mask, old, adv, ret, p, normalizer=G) for p in parts)
    (g_summed,) = torch.autograd.grad(summed, logits)
    torch.testing.assert_close(summed, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_summed, g_full, atol=1e-7, rtol=1e-5)
    # the DeepSpeed convention: W ranks with k micro-batches each, every loss divided by k (gradient
    # accumulation) and the gradients averaged over ranks, with normalizer = G / (W k)
    W = 2
    ranks = [[0, 1, 2], [3, 4, 5]]
    k = max(count_micro_batches([tokens[i] for i in r], 7) for r in ranks)
    grads = []
    for r in ranks:
        mbs = token_budget_micro_batches([tokens[i] for i in r], 7, k)
        loss = sum(_losses(logits, actions, mask, old, adv, ret, [r[i] for i in mb], normalizer=G / (W * k)) / k
                   for mb in mbs)
        grads.append(torch.autograd.grad(loss, logits)[0])
    torch.testing.assert_close(sum(grads) / W, g_full, atol=1e-7, rtol=1e-5)
