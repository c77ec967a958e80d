"""verl_ds.rollout.collect on a real tiny Llama, the built-in tokenizer and real reward functions: DAPO's dynamic
sampling (groups without signal dropped, more rounds drawn, capped, topped up), its overlong penalty against the
paper's formula by hand, and ReMax's greedy baseline against HF greedy decoding done separately."""
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_ds.data import collate_prompts
from verl_ds.metrics import Timings
from verl_ds.models import PolicyModel, RewardModel
from verl_ds.rollout import collect
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

N, B = 4, 3  # samples per prompt, prompts per round
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.fixture(scope="module")
def parts():
    tok = build_tokenizer(parity.VOCAB)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)  # a seed whose greedy responses differ between the prompts (ReMax test)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return tok, model, PolicyModel(model, tokenizer=tok)


def rounds_of_prompts(tok):
    """draw_prompts for collect: round r holds B prompts tagged r (a counter of the calls made)."""
    calls = itertools.count()
    texts = ["odd : 3 =>", "even : 2 4 =>", "odd : 1 5 7 =>", "even : 8 =>", "odd : 9 2 =>", "even : 6 6 =>"]

    def draw():
        r = next(calls)
        items = [{"input_ids": tok(t)["input_ids"], "prompt": f"{r}|{t}"} for t in texts[r * B % 6:][:B]]
        return collate_prompts(items, tok.pad_token_id)

    draw.calls = calls
    return draw


def reward_of(fn):
    reward = RewardModel()
    reward.register_reward_fn(fn, name="test_reward")
    return reward


def test_groups_without_signal_are_dropped_until_the_cap_then_topped_up(parts):
    tok, _, policy = parts
    draw = rounds_of_prompts(tok)
    ro = collect(draw, policy, reward_of(lambda prompts, responses, batch: [1.0] * len(responses)), tok,
                 sampling=SAMPLING, n=N, timings=Timings(), dynamic=True, max_rounds=3)
    assert next(draw.calls) == 3  # every round had no signal: the cap of 3 rounds was reached
    m = {k: float(v) for k, v in ro.metrics.items() if k.startswith("rollout/")}
    assert (m["rollout/sampling_rounds"], m["rollout/groups_dropped"], m["rollout/groups_filled"]) == (3, 3 * B, B)
    assert len(ro.batch) == B * N and len(ro.responses) == B * N


def test_rounds_are_drawn_until_every_group_carries_signal(parts):
    tok, _, policy = parts
    draw = rounds_of_prompts(tok)

    def score(prompts, responses, batch):  # round 0: all equal (no signal); later: alternating 0/1 in each group
        return [0.5 if p.startswith("0|") else float(i % 2) for i, p in enumerate(prompts)]

    ro = collect(draw, policy, reward_of(score), tok, sampling=SAMPLING, n=N, timings=Timings(), dynamic=True,
                 max_rounds=5)
    assert next(draw.calls) == 2
    m = {k: float(v) for k, v in ro.metrics.items() if k.startswith("rollout/")}
    assert (m["rollout/sampling_rounds"], m["rollout/groups_dropped"], m["rollout/groups_filled"]) == (2, B, 0)
    assert len(ro.batch) == B * N
    assert all(p.startswith("1|") for p in ro.batch.extras["prompt"])  # only round 1's groups are kept
    assert ro.batch.group_index.tolist() == [B + g for g in range(B) for _ in range(N)]  # unique over rounds
    scores = ro.batch.scores.sum(-1).view(B, N)
    assert bool((scores.max(1).values > scores.min(1).values).all())


def test_overlong_penalty_is_dapos_soft_penalty_by_hand(parts):
    tok, _, policy = parts
    buffer, factor, L = 4, 0.5, SAMPLING["max_new_tokens"]
    torch.manual_seed(11)
    ro = collect(rounds_of_prompts(tok), policy, reward_of(lambda p, r, b: [1.0] * len(r)), tok, sampling=SAMPLING,
                 n=N, timings=Timings(), overlong=(buffer, factor))
    lengths = ro.batch.response_length.tolist()
    assert len(set(lengths)) > 1  # several lengths, so the penalty is checked on more than one branch
    for row, length in zip(ro.batch.scores, lengths):
        # DAPO (Yu et al. 2025, eq. 13): 0 up to L - buffer, then -(length - (L - buffer)) / buffer, x factor
        penalty = 0.0 if length <= L - buffer else ((L - buffer) - length) / buffer * factor
        assert row[length - 1].item() == pytest.approx(1.0 + penalty)
        assert row.sum().item() == pytest.approx(1.0 + penalty)


def test_remax_baseline_is_the_score_of_the_greedy_response(parts):
    tok, model, policy = parts

    def score(prompts, responses, batch):  # a score that depends on the response text
        return [float(sum(map(ord, r)) % 97) for r in responses]

    draw = rounds_of_prompts(tok)
    ro = collect(draw, policy, reward_of(score), tok, sampling=SAMPLING, n=N, timings=Timings(),
                 greedy_baseline=True)
    prompts = rounds_of_prompts(tok)()  # the same first round, drawn again
    with torch.no_grad():
        out = model.generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"].long(),
                             do_sample=False, max_new_tokens=SAMPLING["max_new_tokens"], pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    expected = []
    for row in out[:, prompts["input_ids"].shape[1]:].tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        expected.append(float(sum(map(ord, tok.decode(row, skip_special_tokens=True))) % 97))
    assert len(set(expected)) > 1  # the greedy responses differ, so the baseline is matched prompt by prompt
    assert ro.batch.extras["baseline_score"] == [s for s in expected for _ in range(N)]


def _overlong(length, buffer, factor, L=SAMPLING["max_new_tokens"]):
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13) by hand."""
    return 0.0 if length <= L - buffer else ((L - buffer) - length) / buffer * factor


def test_dynamic_sampling_filters_on_the_reward_before_the_overlong_penalty(parts):
    """Issue 30 item 11: every response is right (reward 1.0), so no group carries signal; the overlong penalty
    varies with the length but says nothing about the answer (DAPO filters on accuracy, verl's recipe on
    filter_groups.metric): every group is dropped, the batch is topped up, and the kept scores are still shaped."""
    tok, _, policy = parts
    buffer, factor = SAMPLING["max_new_tokens"], 0.5  # every length gets its own penalty
    torch.manual_seed(11)
    ro = collect(rounds_of_prompts(tok), policy, reward_of(lambda p, r, b: [1.0] * len(r)), tok, sampling=SAMPLING,
                 n=N, timings=Timings(), dynamic=True, max_rounds=2, overlong=(buffer, factor))
    lengths = ro.batch.response_length.tolist()
    assert any(len(set(lengths[g * N:(g + 1) * N])) > 1 for g in range(B))  # shaped scores differ in a group
    m = {k: float(v) for k, v in ro.metrics.items() if k.startswith("rollout/")}
    assert (m["rollout/sampling_rounds"], m["rollout/groups_dropped"], m["rollout/groups_filled"]) == (2, 2 * B, B)
    for row, length in zip(ro.batch.scores, lengths):
        assert row.sum().item() == pytest.approx(1.0 + _overlong(length, buffer, factor))


def test_remax_baseline_gets_the_overlong_penalty_its_samples_get(parts):
    """Issue 30 item 11: the greedy baseline is scored like the samples it is subtracted from (reward + DAPO's
    overlong penalty at its own length), checked against HF greedy decoding done separately."""
    tok, model, policy = parts
    buffer, factor = SAMPLING["max_new_tokens"], 0.5
    ro = collect(rounds_of_prompts(tok), policy, reward_of(lambda p, r, b: [1.0] * len(r)), tok, sampling=SAMPLING,
                 n=N, timings=Timings(), greedy_baseline=True, overlong=(buffer, factor))
    prompts = rounds_of_prompts(tok)()
    with torch.no_grad():
        out = model.generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"].long(),
                             do_sample=False, max_new_tokens=SAMPLING["max_new_tokens"], pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    expected = []
    for row in out[:, prompts["input_ids"].shape[1]:].tolist():  # the length counts the EOS, as the batch's
        length = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else SAMPLING["max_new_tokens"]
        expected.append(1.0 + _overlong(length, buffer, factor))
    assert any(e != 1.0 for e in expected)  # a penalised greedy response: the test can tell shaped from unshaped
    assert ro.batch.extras["baseline_score"] == pytest.approx([s for s in expected for _ in range(N)], abs=1e-6)


def test_reward_metrics_are_those_of_the_rows_trained_not_of_the_last_round(parts):
    """Dynamic sampling keeps groups of two rounds and drops others: the step's reward metrics are the means over
    the rows it trains (they were the last round's, all its groups, dropped ones included)."""
    tok, _, policy = parts
    buffer, factor = SAMPLING["max_new_tokens"], 0.5

    def score(prompts, responses, batch):  # round 0: group 0 [0, 0, 0, 1], groups 1-2 all 0; round 1: [1, 1, 1, 0]
        if prompts[0].startswith("0|"):
            return [float(i == N - 1) for i in range(len(prompts))]
        return [float(i % N != N - 1) for i in range(len(prompts))]

    ro = collect(rounds_of_prompts(tok), policy, reward_of(score), tok, sampling=SAMPLING, n=N, timings=Timings(),
                 dynamic=True, max_rounds=2, overlong=(buffer, factor))
    assert [p[0] for p in ro.batch.extras["prompt"][::N]] == ["0", "1", "1"]  # round 0's group 0, round 1's 0 and 1
    penalties = [_overlong(length, buffer, factor) for length in ro.batch.response_length.tolist()]
    assert float(ro.metrics["reward/test_reward/mean"]) == pytest.approx((0.25 + 0.75 + 0.75) / 3)
    assert float(ro.metrics["reward/test_reward/mean"]) == pytest.approx(
        float(ro.batch.scores.sum(-1).mean()) - sum(penalties) / len(penalties), abs=1e-6)
    assert float(ro.metrics["reward/overlong_penalty/mean"]) == pytest.approx(sum(penalties) / len(penalties))
