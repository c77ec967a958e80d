"""PolicyModel and ReferenceModel: log-probs and entropies against hand-computed bigram probabilities, whole
responses from get_action (greedy paths, sampled paths, vLLM-order truncation, the rollout-vs-trainer match on a
real Llama), thread safety, update with a hand-computed gradient."""
import math
import threading

import pytest
import torch

from verl_ds.batch import RolloutBatch
from verl_ds.models import ActionRole, LogProbRole, PolicyModel, ReferenceModel, TrainableRole
from verl_ds.state import SharedState

from models_testutil import BOS, EOS, PAD, PlainBigram, bigram_table, make_bigram_lm

# p(b | a) = weight / row sum. Every row reachable from 3..7 is listed, so every sampled path is hand-computable.
ROWS = {
    3: {4: 1, 5: 1, 6: 2},  # greedy: 6 (1/2)
    4: {5: 3, EOS: 1},  # greedy: 5 (3/4)
    5: {4: 2, 7: 1, EOS: 1},  # greedy: 4 (1/2)
    6: {EOS: 3, 3: 1},  # greedy: EOS (3/4)
    7: {3: 1.0, 4: math.e, 5: math.e ** 2},  # logits 0, 1, 2 on tokens 3, 4, 5
}


def p(a, b, temperature=1.0):
    """Hand probability of token b after token a under softmax(logits / temperature): w^(1/T) normalised."""
    w = {k: v ** (1.0 / temperature) for k, v in ROWS[a].items()}
    return w.get(b, 0.0) / sum(w.values())


def entropy(a, temperature=1.0):
    return -sum(p(a, b, temperature) * math.log(p(a, b, temperature)) for b in ROWS[a])


@pytest.fixture
def bigram():
    return make_bigram_lm(ROWS)


# ---- roles ---------------------------------------------------------------------------------------------------------

def test_roles_and_methods(bigram):
    pol, ref = PolicyModel(bigram), ReferenceModel(bigram)
    assert isinstance(pol, (ActionRole, LogProbRole, TrainableRole)) and isinstance(pol, ReferenceModel)
    assert isinstance(ref, LogProbRole) and not isinstance(ref, (ActionRole, TrainableRole))
    for name in ("get_action", "update"):
        assert not hasattr(ref, name), name  # the frozen reference neither acts nor trains
    for name in ("get_value", "get_reward"):
        assert not hasattr(pol, name), name
    assert pol.state_dict() == {"lr_key": "actor_lr"} and ref.state_dict() == {}
    with pytest.raises(ValueError, match=r"^Missing required module: lm \(PolicyModel was given: lm=None\)$"):
        PolicyModel(None)
    with pytest.raises(ValueError, match="Missing required module: lm"):
        ReferenceModel(None)


# ---- get_logprob: hand-computed expectations -----------------------------------------------------------------------

@pytest.mark.parametrize("plain", [False, True], ids=["hf_logits_to_keep", "plain_module"])
def test_get_logprob_and_entropy_hand_case(plain, bigram):
    lm = PlainBigram(bigram_table(ROWS)) if plain else bigram
    model = ReferenceModel(lm)
    # row 0: prompt [PAD, 3], response 4 5 7; row 1: prompt [3, 6], response EOS then padding (mask False)
    obs = torch.tensor([[PAD, 3, 4, 5, 7], [3, 6, EOS, PAD, PAD]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    action = obs[:, 2:]
    for T in (1.0, 0.5):
        lp, ent = model.get_logprob(obs, action, mask, temperature=T, return_entropy=True)
        assert lp.shape == ent.shape == (2, 3) and lp.dtype == ent.dtype == torch.float32
        want_lp = [[math.log(p(3, 4, T)), math.log(p(4, 5, T)), math.log(p(5, 7, T))], [math.log(p(6, EOS, T))]]
        want_ent = [[entropy(3, T), entropy(4, T), entropy(5, T)], [entropy(6, T)]]
        torch.testing.assert_close(lp[0], torch.tensor(want_lp[0]), atol=1e-6, rtol=0)
        torch.testing.assert_close(lp[1, :1], torch.tensor(want_lp[1]), atol=1e-6, rtol=0)
        torch.testing.assert_close(ent[0], torch.tensor(want_ent[0]), atol=1e-6, rtol=0)
        torch.testing.assert_close(ent[1, :1], torch.tensor(want_ent[1]), atol=1e-6, rtol=0)
        torch.testing.assert_close(model.get_logprob(obs, action, mask, temperature=T), lp)
    # the hand numbers themselves: log(1/4), log(3/4), log(1/4); entropy of (1/4, 1/4, 1/2) = 1.5 log 2
    assert p(3, 4) == 0.25 and p(4, 5) == 0.75 and entropy(3) == pytest.approx(1.5 * math.log(2))


def test_get_logprob_real_llama_matches_prefix_loop(tiny_lm, make_rollout):
    """Reference: for each response token, a forward over the unpadded prefix that precedes it (no slicing shared
    with the code under test), log_softmax in float64 of its last position."""
    b = make_rollout()
    pol = PolicyModel(tiny_lm)
    lp, ent = pol.get_logprob(b.observation, b.action, mask=b.mask, temperature=0.8, return_entropy=True)
    for i in range(len(b)):
        real = b.observation[i][b.mask[i]]  # prompt then response, no padding
        n_prompt = int(b.prompt_length[i])
        for j in range(int(b.response_length[i])):
            with torch.no_grad():
                logits = tiny_lm(input_ids=real[None, :n_prompt + j]).logits[0, -1].double() / 0.8
            logp = torch.log_softmax(logits, -1)
            assert lp[i, j].item() == pytest.approx(logp[real[n_prompt + j]].item(), abs=1e-5)
            assert ent[i, j].item() == pytest.approx(-(logp.exp() * logp).sum().item(), abs=1e-5)


def test_left_padding_does_not_change_logprobs(tiny_lm):
    pol = PolicyModel(tiny_lm)
    seq = torch.tensor([[7, 8, 9, 10, 11, 12]])
    padded = torch.tensor([[PAD, PAD, PAD, 7, 8, 9, 10, 11, 12]])
    lp1 = pol.get_logprob(seq, seq[:, -3:], torch.ones_like(seq, dtype=torch.bool))
    lp2 = pol.get_logprob(padded, padded[:, -3:], padded != PAD)
    torch.testing.assert_close(lp1, lp2, atol=1e-5, rtol=0)


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
    with pytest.raises(ValueError, match="PolicyModel.get_logprob: temperature must be a float > 0, got 0"):
        pol.get_logprob(b.observation, b.action, b.mask, temperature=0)


class WrongLogits(torch.nn.Module):
    """A real module whose output breaks the (B, T, V) logits contract."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return torch.zeros(input_ids.shape[0], 7)


class ShortLogits(torch.nn.Module):
    """Returns logits for the last position only, whatever it is asked."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return torch.zeros(input_ids.shape[0], 1, 50)


def test_lm_contract_errors(make_rollout):
    b = make_rollout()
    with pytest.raises(TypeError, match="lm must be callable"):
        PolicyModel(3)
    with pytest.raises(ValueError, match=r"the lm must return logits of shape \(B, T, V\); got \(4, 7\)"):
        PolicyModel(WrongLogits()).get_logprob(b.observation, b.action, b.mask)
    with pytest.raises(ValueError, match="the lm returned logits for 1 positions, need 5"):
        ReferenceModel(ShortLogits()).get_logprob(b.observation, b.action, b.mask)


# ---- get_action: whole responses -----------------------------------------------------------------------------------

def test_greedy_responses_hand_paths(bigram):
    pol = PolicyModel(bigram)
    prompts = torch.tensor([[PAD, BOS, 3], [BOS, 7, 4]])
    action, lp, ent = pol.get_action(prompts, prompts != PAD, temperature=0.5, top_k=1, max_new_tokens=4,
                                     greedy=True)
    assert action.dtype == torch.int64 and lp.dtype == ent.dtype == torch.float32
    assert action.tolist() == [[6, EOS, PAD, PAD], [5, 4, 5, 4]]  # 3 -> 6 -> EOS; 4 -> 5 -> 4 -> ... truncated
    # greedy ignores the sampling knobs: log-probs and entropies at temperature 1
    want_lp = [[math.log(1 / 2), math.log(3 / 4), 0.0, 0.0],
               [math.log(3 / 4), math.log(1 / 2), math.log(3 / 4), math.log(1 / 2)]]
    want_ent = [[entropy(3), entropy(6), 0.0, 0.0], [entropy(4), entropy(5), entropy(4), entropy(5)]]
    torch.testing.assert_close(lp, torch.tensor(want_lp), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor(want_ent), atol=1e-6, rtol=0)


def test_every_row_stops_early_still_gives_full_width(bigram):
    pol = PolicyModel(bigram)
    prompts = torch.tensor([[6], [6]])
    action, lp, ent = pol.get_action(prompts, None, max_new_tokens=5, greedy=True)
    assert action.tolist() == [[EOS, PAD, PAD, PAD, PAD]] * 2
    torch.testing.assert_close(lp, torch.tensor([[math.log(3 / 4), 0, 0, 0, 0]] * 2), atol=1e-6, rtol=0)
    assert ent[:, 1:].abs().sum() == 0


def check_sampled_paths(prompt_last, action, lp, ent, temperature):
    """Each row's log-probs/entropies are the hand values along its own path; after EOS: pad and zeros."""
    for i in range(action.shape[0]):
        prev, ended = int(prompt_last[i]), False
        for j, tok in enumerate(action[i].tolist()):
            if ended:
                assert tok == PAD and lp[i, j] == 0 and ent[i, j] == 0, (i, j)
                continue
            assert tok in ROWS[prev], (i, j, prev, tok)  # a token of probability 0 never comes out
            assert lp[i, j].item() == pytest.approx(math.log(p(prev, tok, temperature)), abs=1e-5)
            assert ent[i, j].item() == pytest.approx(entropy(prev, temperature), abs=1e-5)
            ended, prev = tok == EOS, tok


def test_sampled_responses_carry_untruncated_log_probs(bigram):
    torch.manual_seed(0)
    pol = PolicyModel(bigram)
    prompts = torch.tensor([[PAD, 3], [5, 4]]).repeat(32, 1)
    action, lp, ent = pol.get_action(prompts, prompts != PAD, temperature=0.7, top_k=0, top_p=1.0,
                                     max_new_tokens=4)
    assert action.shape == lp.shape == ent.shape == (64, 4)
    check_sampled_paths(prompts[:, -1], action, lp, ent, 0.7)
    ended = (action == EOS).any(-1)
    assert ended.any() and (~ended).any()  # both early ends and truncated rows were checked


@pytest.mark.parametrize("temperature, top_k, top_p, allowed", [
    (1.0, 0, 0.6, {5}),  # p = (0.090, 0.245, 0.665): 0.665 alone reaches 0.6
    (10.0, 0, 0.6, {4, 5}),  # temperature FIRST: p = (0.301, 0.332, 0.367) needs two tokens
    (1.0, 2, 0.7, {5}),  # top-k FIRST: {4, 5} renormalised gives 5 a mass 0.731 >= 0.7 (top-p alone keeps 4 too)
    (1.0, 2, 1.0, {4, 5}),
    (1.0, -1, 1.0, {3, 4, 5}),  # -1 disables top-k
    (1.0, 0, 1.0, {3, 4, 5}),
])
def test_truncation_in_vllm_order(bigram, temperature, top_k, top_p, allowed):
    torch.manual_seed(1)
    pol = PolicyModel(bigram)
    prompts = torch.full((300, 1), 7)  # logits 0, 1, 2 on tokens 3, 4, 5
    action, lp, _ = pol.get_action(prompts, None, temperature=temperature, top_k=top_k, top_p=top_p)
    assert action.shape == (300, 1)
    assert set(action[:, 0].tolist()) == allowed  # only the allowed tokens, and each of them (300 draws)
    for tok in allowed:  # the log-prob of the UNtruncated softmax(logits / T)
        want = (tok - 3) / temperature - math.log(sum(math.exp(k / temperature) for k in (0, 1, 2)))
        got = lp[action[:, 0] == tok]
        torch.testing.assert_close(got, torch.full_like(got, want), atol=1e-5, rtol=0)


def test_sampled_log_probs_equal_get_logprob_on_llama(tiny_lm, make_rollout):
    """The rollout-vs-trainer mismatch on a real model: what generation reports is what the trainer recomputes."""
    torch.manual_seed(2)
    b0 = make_rollout()
    prompt, pmask = b0.observation[:, :5], b0.mask[:, :5]
    pol = PolicyModel(tiny_lm)
    action, lp, ent = pol.get_action(prompt, pmask, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=4)
    assert action.shape == lp.shape == ent.shape == (4, 4) and not lp.requires_grad
    b = RolloutBatch.from_generation(prompt, pmask, action, pad_token_id=PAD, eos_token_id=EOS)
    want_lp, want_ent = pol.get_logprob(b.observation, b.action, b.mask, temperature=0.7, return_entropy=True)
    m = b.response_mask
    torch.testing.assert_close(lp[m], want_lp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[m], want_ent[m], atol=1e-5, rtol=0)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()


def test_greedy_equals_argmax_loop_on_llama(tiny_lm, make_rollout):
    """Reference: each row unpadded, one full forward per new token, argmax, stop at EOS."""
    b = make_rollout()
    prompt, pmask = b.observation[:, :5], b.mask[:, :5]
    action, _, _ = PolicyModel(tiny_lm).get_action(prompt, pmask, max_new_tokens=3, greedy=True)
    for i in range(4):
        seq, want = prompt[i][pmask[i]].tolist(), []
        while len(want) < 3 and (not want or want[-1] != EOS):
            with torch.no_grad():
                nxt = int(tiny_lm(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            want.append(nxt)
        assert action[i].tolist() == want + [PAD] * (3 - len(want)), i


def test_get_action_threads(tiny_lm, bigram, make_rollout):
    """8 threads at once: greedy results equal the sequential ones; sampled results are valid paths."""
    b = make_rollout()
    prompt, pmask = b.observation[:, :5], b.mask[:, :5]
    llama, bi = PolicyModel(tiny_lm), PolicyModel(bigram)
    sequential = llama.get_action(prompt, pmask, max_new_tokens=3, greedy=True)
    bi_prompts = torch.tensor([[3], [4], [7]])
    results, errors = [None] * 8, []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            if i % 2:
                results[i] = llama.get_action(prompt, pmask, max_new_tokens=3, greedy=True)
            else:
                results[i] = bi.get_action(bi_prompts, None, temperature=1.3, max_new_tokens=3)
        except Exception as e:  # surfaced below: an exception in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, res in enumerate(results):
        if i % 2:
            for x, y in zip(sequential, res):
                assert torch.equal(x, y)
        else:
            check_sampled_paths(bi_prompts[:, -1], *res, 1.3)


def test_get_action_argument_errors(bigram):
    pol = PolicyModel(bigram)
    obs = torch.tensor([[PAD, 3, 4], [3, 4, 5]])
    mask = obs != PAD
    with pytest.raises(ValueError, match=r"mask must have the shape of observation, \(B, T\) = \(2, 3\), got "
                                         r"\(2, 3, 3\)"):
        pol.get_action(obs, mask.unsqueeze(1).expand(2, 3, 3))
    with pytest.raises(ValueError, match="temperature must be a float > 0, got 0"):
        pol.get_action(obs, mask, temperature=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        pol.get_action(obs, mask, top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        pol.get_action(obs, mask, top_k=-3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        pol.get_action(obs, mask, max_new_tokens=0)
    right_padded = torch.tensor([[5, 6, PAD]])
    with pytest.raises(ValueError, match=r"the last column must be a real token in every row.*rows \[0\]"):
        pol.get_action(right_padded, right_padded != PAD)
    with pytest.raises(TypeError, match="observation must hold int64 token ids"):
        pol.get_action(obs.float(), mask)
    with pytest.raises(ValueError, match=r"mask rows \[0\] have no real token"):
        pol.get_action(obs, torch.zeros_like(mask).index_fill_(0, torch.tensor([1]), True))


def test_get_action_needs_pad_and_eos_ids(bigram):
    bigram.config.pad_token_id = None
    with pytest.raises(ValueError, match="the model config has no pad_token_id/eos_token_id; pass tokenizer="):
        PolicyModel(bigram).get_action(torch.tensor([[3]]))

    class Ids:
        pad_token_id, eos_token_id, bos_token_id = PAD, 6, BOS

    # a tokenizer's ids win over the config's: with 6 as EOS, 3 -> 6 ends the response at once
    action, _, _ = PolicyModel(bigram, tokenizer=Ids()).get_action(torch.tensor([[3]]), max_new_tokens=3, greedy=True)
    assert action.tolist() == [[6, PAD, PAD]]


# ---- update: a hand-computed gradient ------------------------------------------------------------------------------

def test_update_steps_at_hot_lr_with_hand_gradient(bigram):
    state = SharedState(rank=0)
    state.set("actor_lr", 0.5)
    opt = torch.optim.SGD(bigram.parameters(), lr=123.0)
    pol = PolicyModel(bigram, state=state, optimizer=opt)
    obs, action = torch.tensor([[3, 4]]), torch.tensor([[4]])
    before = bigram.table.detach().clone()
    loss = -pol.get_logprob(obs, action).sum()  # -log p(4 | 3) = log 4
    assert loss.item() == pytest.approx(math.log(4), abs=1e-6)
    out = pol.update(None, {"loss": loss})
    # d(-log p_4)/d logits[3] = softmax - onehot(4) = (-3/4 on 4, 1/4 on 5, 1/2 on 6); norm sqrt(14) / 4
    assert set(out) == {"grad_norm", "skipped", "zero_stage"} and out["skipped"] is False and out["zero_stage"] == 0
    assert float(out["grad_norm"]) == pytest.approx(math.sqrt(14) / 4, abs=1e-6)
    assert opt.param_groups[0]["lr"] == 0.5
    step = bigram.table.detach() - before
    want = torch.zeros_like(step)
    want[3, 4], want[3, 5], want[3, 6] = 0.5 * 3 / 4, -0.5 / 4, -0.5 / 2
    torch.testing.assert_close(step, want, atol=1e-6, rtol=0)
    assert all(p.grad is None for p in bigram.parameters())


def test_update_skip_drops_the_step(bigram):
    opt = torch.optim.SGD(bigram.parameters(), lr=1.0)
    pol = PolicyModel(bigram, optimizer=opt)
    before = bigram.table.detach().clone()
    loss = -pol.get_logprob(torch.tensor([[3, 4]]), torch.tensor([[4]])).sum()
    out = pol.update(None, {"loss": loss, "skip": True})
    assert out["skipped"] is True and float(out["grad_norm"]) == pytest.approx(math.sqrt(14) / 4, abs=1e-6)
    assert torch.equal(bigram.table, before) and bigram.table.grad is None


def test_update_errors(bigram):
    pol = PolicyModel(bigram, optimizer=torch.optim.SGD(bigram.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="PolicyModel.update: config must hold 'loss'"):
        pol.update(None, {})
    with pytest.raises(ValueError, match=r"config\['loss'\] must be a scalar tensor that requires grad"):
        pol.update(None, {"loss": torch.tensor(1.0)})
    loss = -PolicyModel(bigram).get_logprob(torch.tensor([[3, 4]]), torch.tensor([[4]])).sum()
    with pytest.raises(ValueError, match="PolicyModel.update got a loss but has no optimizer"):
        PolicyModel(bigram).update(None, {"loss": loss})


def test_update_forward_is_scoring_pass_only_without_acting_dropout():
    """Issue 30 item 10: the trainer reuses the update's own log-probs as the old ones only when no dropout acts in
    the update's forward: an nn.Dropout with p > 0 or HF attention's own rate, in a module in training mode."""
    from transformers import AutoModelForCausalLM

    from models_testutil import tiny_llama_config
    from verl_ds.engines.build import disable_dropout

    lm = AutoModelForCausalLM.from_config(tiny_llama_config(attention_dropout=0.1)).train()
    policy = PolicyModel(lm)
    assert not policy.update_forward_is_scoring_pass  # attention_dropout acts in training mode
    lm.eval()
    assert policy.update_forward_is_scoring_pass  # HF attention drops only when training
    lm.train()
    disable_dropout(lm)
    assert policy.update_forward_is_scoring_pass
    lm.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.3))
    assert not policy.update_forward_is_scoring_pass
    lm.model.layers[0].mlp.drop.p = 0.0
    assert policy.update_forward_is_scoring_pass
