"""PPO with a critic on the built-in tool task (configs/agent_calc_ppo.yaml): what its advantages make of the
multi-turn batches the task gives early on, when nearly every trajectory scores 0 and a success is rare.

A batch without a success must move the policy by no more than the critic's error (whitening would scale that error
up to unit advantages, a random push every step), and a success must credit its first token, the decision to call
the tool, in full (with lam 0.95 it got ~0.34 of it from a critic that has seen no success). With PPO's defaults
(lam 0.95, whitening) PPO did not learn the task from a start near 0: tool-call rate 0.009 -> 0.022 on seed 0. The expected values come
from a float64 GAE loop over the model's tokens alone (the environment's skipped, as verl's multi-turn GAE)."""
import os
import random

import pytest
import torch

from verl_ds.agent.episodes import Trajectory
from verl_ds.agent.rollout import trajectories_to_batch
from verl_ds.config import load_config
from verl_ds.models import PolicyModel, PPOModel, RewardModel, ValueModel
from verl_ds.state import SharedState

from models_testutil import EOS, PAD, TokenValueNet, make_bigram_lm
from ppo_testutil import ROWS

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "agent_calc_ppo.yaml")
CALL, ENV, ANSWER = [4, 5, 6, 5, 4], [7, 8], [6, 6]  # a tool call, the tool's answer, the final answer


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


def ppo_of(cfg) -> PPOModel:
    """A PPOModel with the config's algo section and state (gamma, lam, kl_coef as a run starts them)."""
    return PPOModel(PolicyModel(make_bigram_lm(ROWS)), RewardModel(), critic=ValueModel(TokenValueNet({3: 0.5})),
                    state=SharedState.from_config(cfg), algo=cfg.algo)


def episode(calls: bool, reward: float) -> Trajectory:
    t = Trajectory(prompt_ids=[3])
    pieces = [(CALL, True), (ENV, False), (ANSWER + [EOS], True)] if calls else [(ANSWER + [EOS], True)]
    for ids, sampled in pieces:
        t.append(ids, sampled, [-0.5] * len(ids) if sampled else None)
    t.reward = reward
    t.finish("done")
    return t


def batch_with_values(trajs, seed: int, scale: float):
    """The trajectories' batch with critic values uniform in [-scale, scale] everywhere (environment tokens too:
    they must be ignored)."""
    batch, mismatches = trajectories_to_batch(trajs, pad_token_id=PAD, eos_token_id=EOS)
    assert mismatches == 0
    g = torch.Generator().manual_seed(seed)
    batch.values = (torch.rand(batch.response_mask.shape, generator=g) * 2 - 1) * scale
    return batch


def gae_f64(batch, gamma: float, lam: float) -> torch.Tensor:
    """GAE by a float64 loop over each row's model tokens alone; 0 elsewhere."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    for i in range(len(batch)):
        model = batch.response_mask[i].nonzero().flatten().tolist()
        g, nxt = 0.0, 0.0
        for t in reversed(model):
            v = float(batch.values[i, t])
            g = float(batch.scores[i, t]) + gamma * nxt - v + gamma * lam * g
            out[i, t], nxt = g, v
    return out


def test_the_config_is_ppo_with_a_critic(cfg):
    assert cfg.algo.adv_estimator == "gae" and cfg.agent.environment == "calc"
    assert ppo_of(cfg).needs_critic


def test_a_batch_without_a_success_moves_by_the_critics_error_only(cfg):
    rng = random.Random(0)
    trajs = [episode(calls=rng.random() < 0.3, reward=0.0) for _ in range(16)]
    batch = batch_with_values(trajs, seed=1, scale=1e-3)
    ppo = ppo_of(cfg)
    ppo.compute_advantage(batch)
    want = gae_f64(batch, ppo.state.get("gamma"), ppo.state.get("lam"))
    torch.testing.assert_close(batch.advantages.double(), want, rtol=0, atol=1e-6)
    # every return is 0: each advantage is minus the critic's value there, never more than its error
    rm = batch.response_mask
    torch.testing.assert_close(batch.advantages[rm], -batch.values[rm], rtol=0, atol=1e-6)
    assert float(batch.advantages.abs().max()) <= 1e-3 + 1e-6


def test_a_success_credits_the_decision_to_call_in_full(cfg):
    trajs = [episode(calls=True, reward=1.0)] + [episode(calls=k % 3 == 0, reward=0.0) for k in range(15)]
    batch = batch_with_values(trajs, seed=2, scale=1e-2)
    ppo = ppo_of(cfg)
    ppo.compute_advantage(batch)
    want = gae_f64(batch, ppo.state.get("gamma"), ppo.state.get("lam"))
    torch.testing.assert_close(batch.advantages.double(), want, rtol=0, atol=1e-6)
    first = float(batch.advantages[0, 0])  # the <tool_call> token: 1 - V(prompt), by hand for gamma = lam = 1
    assert first == pytest.approx(1.0 - float(batch.values[0, 0]), abs=1e-6)
    others = batch.advantages[1:][batch.response_mask[1:]]
    assert first > 0.9 and float(others.abs().max()) <= 1e-2 + 1e-6
