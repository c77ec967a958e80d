"""Hand-built pieces for the PPOModel tests: a bigram actor whose probabilities are known, a table critic, literal
batches, and the hand-derived numbers the tests expect (a plain module: conftest.py names clash across folders)."""
import dataclasses
import math

import torch

from verl_ds.batch import RolloutBatch
from verl_ds.config import AlgoConfig
from verl_ds.models import PolicyModel, PPOModel, ReferenceModel, RewardModel, ValueModel
from verl_ds.state import SharedState

from models_testutil import EOS, PAD, TokenValueNet, make_bigram_lm

ROWS = {3: {4: 1, 5: 1, 6: 2}, 4: {5: 3, EOS: 1}, 6: {EOS: 3, 3: 1}}  # p(b | a) = weight / row sum


def H(*ps):
    """Entropy of a distribution given by its probabilities."""
    return -sum(q * math.log(q) for q in ps)


def make_ppo(adv_estimator="gae", critic=True, ref=True, values=None, **algo):
    state = SharedState(rank=0)
    algo = dataclasses.replace(AlgoConfig(), adv_estimator=adv_estimator, **algo)
    reward = RewardModel()
    reward.register_reward_fn(lambda p, r, b: [1.0] * len(p), name="one")
    return PPOModel(PolicyModel(make_bigram_lm(ROWS)), reward,
                    critic=ValueModel(TokenValueNet(values or {3: 0.5, 4: 1.0})) if critic else None,
                    ref=ReferenceModel(make_bigram_lm(ROWS)) if ref else None, state=state, algo=algo)


def batch_of(responses, prompt=3):
    """Prompt [prompt] for every row, the given responses (EOS ends a row; the rest is padding)."""
    responses = torch.tensor(responses)
    prompts = torch.full((responses.shape[0], 1), prompt)
    return RolloutBatch.from_generation(prompts, torch.ones_like(prompts, dtype=torch.bool), responses,
                                        pad_token_id=PAD, eos_token_id=EOS)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, want, atol=1e-6):
    torch.testing.assert_close(x.float(), torch.as_tensor(want, dtype=torch.float32), atol=atol, rtol=0)


def assert_scalar_metrics(metrics):
    for key, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, key


def gae_batch():
    """B=2, R=3: row 0 three tokens, row 1 two (EOS) then padding."""
    b = batch_of([[4, 5, 6], [6, EOS, PAD]])
    assert b.response_mask.tolist() == [[True, True, True], [True, True, False]]
    b.scores = t([[0, 0, 1], [0, 2, 0]])
    b.values = t([[0.5, 0.2, 0.4], [1.0, -1.0, 99.0]])  # 99 sits on padding: must be ignored
    b.old_log_probs = t([[-1.0, -0.5, -0.2], [-0.3, -0.4, 0.0]])
    b.ref_log_probs = t([[-1.2, -0.5, -0.1], [-0.3, -0.9, 0.0]])
    return b


# k1 KL = old - ref = [[0.2, 0, -0.1], [0, 0.5, -]]; kl_coef 0.5: token rewards = scores - 0.5 KL
GAE_REWARDS = [[-0.1, 0.0, 1.05], [0.0, 1.75, 0.0]]
# gamma = lam = 0.5, V after the last real token = 0:
#   row 0: d2 = 1.05 - 0.4 = 0.65; d1 = 0 + 0.5*0.4 - 0.2 = 0; d0 = -0.1 + 0.5*0.2 - 0.5 = -0.5
#          A2 = 0.65, A1 = 0 + 0.25*0.65 = 0.1625, A0 = -0.5 + 0.25*0.1625 = -0.459375
#   row 1: d1 = 1.75 - (-1) = 2.75; d0 = 0 + 0.5*(-1) - 1 = -1.5; A1 = 2.75, A0 = -1.5 + 0.25*2.75 = -0.8125
GAE_ADV = [[-0.459375, 0.1625, 0.65], [-0.8125, 2.75, 0.0]]
GAE_RET = [[0.040625, 0.3625, 1.05], [0.1875, 1.75, 0.0]]  # A + V on the response


def policy_batch(ratios, advantages):
    """Rows 3 -> 4 5 and 3 -> 6 EOS; old_log_probs set so that exp(log_probs - old_log_probs) = ratios."""
    b = batch_of([[4, 5], [6, EOS]])
    lp = [[math.log(1 / 4), math.log(3 / 4)], [math.log(1 / 2), math.log(3 / 4)]]  # from ROWS
    b.old_log_probs = t([[lp[i][j] - math.log(ratios[i][j]) for j in range(2)] for i in range(2)])
    b.advantages = t(advantages)
    b.ref_log_probs = t(lp)
    return b


# ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5, A=+2: max(-1.0, -1.6) = -1.0;
# ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); ratio 5, A=-1: max(5, 1.2) = 5, dual clip min(5, 3) = 3.
RATIOS, ADVANTAGES, TOKEN_LOSSES = [[1.5, 0.5], [0.5, 5.0]], [[1.0, 2.0], [-1.0, -1.0]], [-1.2, -1.0, 0.8, 3.0]
MEAN_ENTROPY = (2 * H(1 / 4, 1 / 4, 1 / 2) + H(3 / 4, 1 / 4) + H(3 / 4, 1 / 4)) / 4  # rows 3, 4 | 3, 6


def value_batch():
    """One row 3 -> 4 5 with literal rollout values and returns."""
    b = batch_of([[4, 5]])  # values before the response tokens: after 3 (0.5) and after 4 (1.0)
    b.values = t([[0.0, 0.9]])  # the rollout's
    b.returns = t([[1.0, 0.0]])
    return b
