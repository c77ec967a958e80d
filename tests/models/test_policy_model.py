"""PolicyModel: vLLM-order sampling, exact log-probs, left padding, thread safety, gradients."""
import math
import threading

import pytest
import torch

from verl_ds.models import PolicyModel
from verl_ds.models.policy import filter_logits
from verl_ds.state import SharedState

from models_testutil import PAD


def ref_logprobs(lm, obs, mask, R, temperature):
    """float64 reference: full forward, log_softmax over the positions that predict the response."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = lm(input_ids=obs, attention_mask=mask.long(), position_ids=pos).logits.double() / temperature
    logp = torch.log_softmax(logits[:, -R - 1:-1], -1)
    lp = logp.gather(-1, obs[:, -R:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def test_filter_logits_hand_cases():
    x = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    assert torch.equal(filter_logits(x, 2.0, 0, 1.0), x / 2)  # disabled truncation
    assert torch.equal(filter_logits(x, 1.0, -1, 1.0), x)  # -1 disables too
    out = filter_logits(x, 1.0, 2, 1.0)
    assert out.tolist() == [[-math.inf, 4.0, -math.inf, 3.0]]
    # temperature BEFORE top-p (vLLM): the flatter distribution keeps more tokens
    y = torch.tensor([[0.0, 1.0, 2.0]])  # p = [0.090, 0.245, 0.665]
    assert torch.isinf(filter_logits(y, 1.0, 0, 0.6)).tolist() == [[True, True, False]]
    assert torch.isinf(filter_logits(y, 10.0, 0, 0.6)).tolist() == [[True, False, False]]
    # top-k before top-p: after keeping {1, 2} the renormalised mass of token 2 is 0.731 >= 0.7
    assert torch.isinf(filter_logits(y, 1.0, 2, 0.7)).tolist() == [[True, True, False]]
    # top-p keeps the smallest set reaching p: 0.665 < 0.9, so token 1 stays
    assert torch.isinf(filter_logits(y, 1.0, 0, 0.9)).tolist() == [[True, False, False]]


def test_get_action_logprob_is_untruncated_temperature_distribution(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    obs, mask = b.observation[:, :5], b.mask[:, :5]  # the prompts (left-padded, end with a real token)
    g = torch.Generator().manual_seed(0)
    action, logprob, entropy = pol.get_action(obs, mask, temperature=0.7, top_k=5, top_p=0.9, generator=g)
    assert action.shape == logprob.shape == entropy.shape == (4,)
    assert action.dtype == torch.int64 and logprob.dtype == entropy.dtype == torch.float32
    full = torch.cat([obs, action.unsqueeze(1)], 1)
    lp, ent = ref_logprobs(tiny_lm, full, torch.cat([mask, torch.ones(4, 1, dtype=torch.bool)], 1), 1, 0.7)
    torch.testing.assert_close(logprob.double(), lp[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ent[:, 0], atol=1e-5, rtol=0)
    assert not logprob.requires_grad


def test_get_action_top_k_1_is_greedy_and_respects_truncation(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    obs, mask = b.observation[:, :5], b.mask[:, :5]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        last = tiny_lm(input_ids=obs, attention_mask=mask.long(), position_ids=pos).logits[:, -1]
    action, _, _ = pol.get_action(obs, mask, top_k=1, top_p=1.0)
    assert torch.equal(action, last.argmax(-1))
    top3 = last.topk(3, -1).indices
    for seed in range(5):
        a, _, _ = pol.get_action(obs, mask, temperature=5.0, top_k=3, top_p=1.0,
                                 generator=torch.Generator().manual_seed(seed))
        assert (top3 == a.unsqueeze(1)).any(-1).all()


def test_get_action_eight_threads_match_sequential(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    obs, mask = b.observation[:, :5], b.mask[:, :5]

    def run(seed):
        return pol.get_action(obs, mask, temperature=1.3, top_k=20, top_p=0.9,
                              generator=torch.Generator().manual_seed(seed))

    sequential = [run(s) for s in range(8)]
    results = [None] * 8
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        results[i] = run(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seq, par in zip(sequential, results):
        for x, y in zip(seq, par):
            assert torch.equal(x, y)


def test_get_action_argument_errors(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    obs, mask = b.observation[:, :5], b.mask[:, :5]
    with pytest.raises(ValueError, match=r"mask must have the observation's shape \(B, T\) = \(4, 5\), got \(4, 5, 5\)"):
        pol.get_action(obs, mask.unsqueeze(1).expand(4, 5, 5))
    with pytest.raises(ValueError, match="temperature must be a float > 0, got 0"):
        pol.get_action(obs, mask, temperature=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        pol.get_action(obs, mask, top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        pol.get_action(obs, mask, top_k=-3)
    right_padded = torch.tensor([[5, 6, PAD]])
    with pytest.raises(ValueError, match=r"the last column must be a real token in every row.*rows \[0\]"):
        pol.get_action(right_padded, right_padded != PAD)
    with pytest.raises(TypeError, match="observation must hold int64 token ids"):
        pol.get_action(obs.float(), mask)


def test_get_logprob_matches_float64_reference(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    lp, ent = pol.get_logprob(b.observation, b.action, mask=b.mask, temperature=0.8, return_entropy=True)
    ref_lp, ref_ent = ref_logprobs(tiny_lm, b.observation, b.mask, b.response_width, 0.8)
    assert lp.shape == (4, 4) and lp.dtype == torch.float32
    m = b.response_mask
    torch.testing.assert_close(lp.double()[m], ref_lp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double()[m], ref_ent[m], atol=1e-5, rtol=0)
    only = pol.get_logprob(b.observation, b.action, mask=b.mask, temperature=0.8)
    torch.testing.assert_close(only, lp)


def test_left_padding_does_not_change_logprobs(tiny_lm):
    pol = PolicyModel(tiny_lm)
    seq = torch.tensor([[7, 8, 9, 10, 11, 12]])
    padded = torch.tensor([[PAD, PAD, PAD, 7, 8, 9, 10, 11, 12]])
    lp1 = pol.get_logprob(seq, seq[:, -3:], torch.ones_like(seq, dtype=torch.bool))
    lp2 = pol.get_logprob(padded, padded[:, -3:], padded != PAD)
    torch.testing.assert_close(lp1, lp2, atol=1e-5, rtol=0)


def test_get_logprob_is_differentiable(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    lp = pol.get_logprob(b.observation, b.action, mask=b.mask)
    (lp * b.response_mask).sum().backward()
    grads = [p.grad for p in tiny_lm.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_get_logprob_errors(tiny_lm, make_rollout):
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    bad = b.action.clone()
    bad[2, 0] = (bad[2, 0] + 1) % 50
    with pytest.raises(ValueError, match=r"action must equal the last R=4 columns of observation; rows \[2\] differ"):
        pol.get_logprob(b.observation, bad, b.mask)
    with pytest.raises(ValueError, match=r"action width R=9 must satisfy 1 <= R < T=9"):
        pol.get_logprob(b.observation, b.observation, b.mask)
    with pytest.raises(ValueError, match=r"action must be \(B, R\)"):
        pol.get_logprob(b.observation, b.action[0], b.mask)


def test_policy_has_no_value_or_reward(tiny_lm):
    pol = PolicyModel(tiny_lm)
    obs = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="a policy has no value head; use ValueModel"):
        pol.get_value(obs)
    with pytest.raises(NotImplementedError, match="use RewardModel"):
        pol.get_reward(obs)
    with pytest.raises(ValueError, match="Missing required module: lm"):
        PolicyModel(None)


def test_update_steps_optimizer_at_hot_lr(tiny_lm, make_rollout):
    b = make_rollout()
    state = SharedState(rank=0)
    state.set("actor_lr", 0.01)
    opt = torch.optim.SGD(tiny_lm.parameters(), lr=123.0)
    pol = PolicyModel(tiny_lm, state=state, optimizer=opt)
    before = [p.detach().clone() for p in tiny_lm.parameters()]
    pol.update(b, {})  # no loss: a no-op
    assert all(torch.equal(x, p) for x, p in zip(before, tiny_lm.parameters()))
    loss = -(pol.get_logprob(b.observation, b.action, b.mask) * b.response_mask).mean()
    pol.update(b, {"loss": loss})
    assert opt.param_groups[0]["lr"] == 0.01
    assert any(not torch.equal(x, p) for x, p in zip(before, tiny_lm.parameters()))
    with pytest.raises(ValueError, match=r"config\['loss'\] must be a scalar tensor that requires grad"):
        pol.update(b, {"loss": torch.tensor(1.0)})
    assert pol.state_dict() == {"lr_key": "actor_lr"}


class WrongLogits(torch.nn.Module):
    """A real module whose output breaks the (B, T, V) logits contract."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return torch.zeros(input_ids.shape[0], 7)


def test_lm_contract_errors(make_rollout):
    b = make_rollout()
    with pytest.raises(TypeError, match="lm must be callable"):
        PolicyModel(3)
    with pytest.raises(ValueError, match=r"the lm must return logits of shape \(B, T, V\); got \(4, 7\)"):
        PolicyModel(WrongLogits()).get_logprob(b.observation, b.action, b.mask)
    with pytest.raises(ValueError, match="temperature must be a float > 0, got -1"):
        PolicyModel(WrongLogits()).get_logprob(b.observation, b.action, b.mask, temperature=-1)
