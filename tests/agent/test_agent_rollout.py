"""Trajectories -> RolloutBatch (verl_ds.agent.rollout): the layout by hand, and what the losses and estimators make
of a multi-turn row: the environment's tokens are attended, never trained, and GAE bridges them."""
import math

import pytest
import torch

from verl_ds.agent.episodes import Trajectory
from verl_ds.agent.rollout import episode_metrics, trajectories_to_batch
from verl_ds.batch import BatchValidationError

from models_testutil import EOS, PAD
from ppo_testutil import make_ppo

ENV = [7, 8]  # an environment answer's tokens


def traj(prompt, pieces, reward=0.0, end="done"):
    """``pieces``: (ids, sampled) in order; sampled ids get log-prob -0.1 * (position + 1)."""
    t = Trajectory(prompt_ids=list(prompt))
    for ids, sampled in pieces:
        t.append(ids, sampled, [-0.1 * (len(t.ids) + k + 1) for k in range(len(ids))] if sampled else None)
    t.reward = reward
    t.finish(end)
    return t


def test_layout_by_hand():
    trajs = [traj([3], [([4, EOS], True), (ENV, False), ([6, EOS], True)], reward=1.0),
             traj([9, 3], [([5, EOS], True), (ENV, False)], reward=0.5, end="max_turns"),  # trailing answer: trimmed
             Trajectory(prompt_ids=[])]  # a reset that failed: one inert row
    trajs[2].finish("env_error", "reset raised")
    batch, mismatches = trajectories_to_batch(trajs, pad_token_id=PAD, eos_token_id=EOS)
    assert mismatches == 0
    P = 2
    assert batch.observation.tolist() == [[PAD, 3, 4, EOS, 7, 8, 6, EOS],
                                          [9, 3, 5, EOS, PAD, PAD, PAD, PAD],
                                          [PAD, EOS, EOS, PAD, PAD, PAD, PAD, PAD]]
    assert batch.mask.int().tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert batch.response_mask.int().tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert batch.response_length.tolist() == [6, 2, 1] and batch.prompt_length.tolist() == [1, 2, 1]
    assert batch.done.tolist() == [True, False, False]
    assert batch.scores[0].tolist() == [0, 0, 0, 0, 0, 1.0] and batch.scores[1, 1] == 0.5 and batch.scores[2].sum() == 0
    torch.testing.assert_close(batch.rollout_log_probs[0], torch.tensor([-0.1, -0.2, 0, 0, -0.5, -0.6]))
    assert torch.equal(batch.action, batch.observation[:, P:])
    batch.validate(PAD, required=("observation", "mask", "response_mask", "scores"))


def test_metrics_by_hand():
    a = traj([3], [([4, EOS], True)], end="done")
    a.turns, a.tool_calls, a.tool_errors, a.env_seconds = 2, 3, 1, 0.5
    b = traj([3], [([4, EOS], True)], end="context")
    b.turns = 1
    m = episode_metrics([a, b], mismatches=0)
    assert float(m["agent/turns/mean"]) == 1.5 and float(m["agent/tool_calls/mean"]) == 1.5
    assert float(m["agent/tool_call_rate"]) == 0.5 and float(m["agent/tool_errors/mean"]) == 0.5
    assert float(m["agent/truncated"]) == 0.5 and float(m["agent/end/context"]) == 0.5
    assert float(m["agent/env_seconds/mean"]) == 0.25 and float(m["agent/retokenization_mismatches"]) == 0


def test_a_hole_outside_the_rows_span_is_refused():
    batch, _ = trajectories_to_batch([traj([3], [([4, EOS], True), (ENV, False), ([6, EOS], True)])],
                                     pad_token_id=PAD, eos_token_id=EOS)
    batch.mask = batch.mask.clone()
    batch.mask[0, 3] = False  # an environment token not attended: a broken trajectory, not a hole in the loss
    with pytest.raises(BatchValidationError, match=r"mask\[:, P:\] True exactly on the first response_length"):
        batch.validate(PAD, required=())


def test_gae_skips_the_environment_tokens():
    """Values and rewards at the environment's tokens are ignored: the recursion runs over the model's tokens only,
    as a float64 loop over them alone gives (gamma 0.9, lam 0.8)."""
    ppo = make_ppo("gae", whiten_advantages=False)
    ppo.state.set("gamma", 0.9)
    ppo.state.set("lam", 0.8)
    batch, _ = trajectories_to_batch([traj([3], [([4, 5], True), (ENV, False), ([6, EOS], True)], reward=2.0)],
                                     pad_token_id=PAD, eos_token_id=EOS)
    batch.values = torch.tensor([[0.5, 0.2, 99.0, -99.0, 0.4, 0.1]])
    batch.old_log_probs = batch.ref_log_probs = batch.rollout_log_probs.clone()  # a zero KL
    ppo.compute_advantage(batch)
    model = [0, 1, 4, 5]
    v, r = [0.5, 0.2, 0.4, 0.1], [0.0, 0.0, 0.0, 2.0]
    adv, g = [0.0] * 4, 0.0
    for k in reversed(range(4)):
        nxt = v[k + 1] if k + 1 < 4 else 0.0
        g = r[k] + 0.9 * nxt - v[k] + 0.9 * 0.8 * g
        adv[k] = g
    torch.testing.assert_close(batch.advantages[0, model].double(), torch.tensor(adv, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.returns[0, model].double(), torch.tensor(adv, dtype=torch.float64)
                               + torch.tensor(v, dtype=torch.float64), rtol=0, atol=1e-6)


def test_the_policy_loss_never_trains_the_environment_tokens():
    """The loss and its gradient do not move when the advantages or old log-probs at the environment's tokens change,
    and do when a model token's change."""
    ppo = make_ppo("grpo", critic=False, ref=False)
    ppo.state.set("use_kl_penalty", False)
    batch, _ = trajectories_to_batch([traj([3], [([4, EOS], True), (ENV, False), ([6, EOS], True)], reward=1.0)],
                                     pad_token_id=PAD, eos_token_id=EOS)
    batch.old_log_probs = batch.rollout_log_probs.clone() - 0.05
    batch.advantages = torch.tensor([[1.0, -0.5, 3.0, 3.0, 0.7, 0.2]])

    def loss_and_grad(b):
        params = [p for p in ppo.actor.lm.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        loss, _ = ppo.compute_policy_loss(b)
        loss.backward()
        return float(loss), torch.cat([p.grad.flatten() for p in params if p.grad is not None])

    base_loss, base_grad = loss_and_grad(batch)
    env = batch.clone()
    env.advantages[0, 2:4] = torch.tensor([-50.0, 80.0])
    env.old_log_probs[0, 2:4] = torch.tensor([-9.0, -0.01])
    loss, grad = loss_and_grad(env)
    assert loss == pytest.approx(base_loss, abs=1e-7) and torch.allclose(grad, base_grad)
    model = batch.clone()
    model.advantages[0, 4] = -5.0
    loss, _ = loss_and_grad(model)
    assert not math.isclose(loss, base_loss, abs_tol=1e-4)
