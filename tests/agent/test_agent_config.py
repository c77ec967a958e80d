"""The ``agent`` config section: what is refused at load, each naming the key, and a real run with a user
environment (a class in the user's own module, rows from a data file)."""
import json
import os

import pytest

from verl_ds.config import ConfigError, load_config
from verl_ds.run.checks import check_config

from e2e_utils import ROOT, base_env, read_metrics, run_train

import parity_env

USER_ENV = ["agent.environment=parity_env:ParityHint", "reward.functions=[]"]


def _check(overrides, world_size=1):
    return check_config(load_config(None, overrides), world_size)


def _data(tmp_path):
    for name, n, seed in (("train", 64, 0), ("val", 8, 1)):
        with open(tmp_path / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in parity_env.rows(n, seed))
    return [f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}"]


@pytest.mark.parametrize("overrides, match", [
    (["agent.environment=calcc", "reward.functions=[]"], r"agent.environment: unknown environment 'calcc'; registered: "
                                                         r"\['calc', .*Did you mean 'calc'"),
    (["agent.environment=no_such_module:Env", "reward.functions=[]"], r"agent.environment: .*cannot load 'Env'"),
    (["agent.environment=calc", "reward.functions=[]", "agent.env_args={colour: 1}"],
     r"agent.env_args: environment 'calc': its arguments \['colour'\] do not fit CalcEnvironment"),
    (["agent.environment=calc"], r"agent.environment='calc': the environment's rewards score the trajectories; set "
                                 r"reward.functions: \[\]"),
    (["agent.environment=calc", "reward.functions=[]", "algo.overlong_buffer=2"], r"algo.overlong_buffer: .*agent"),
    (["agent.environment=parity_env:ParityHint", "reward.functions=[]"], r"has no built-in data set .*data.train_files"),
    (["agent.environment=calc", "reward.functions=[]", "agent.max_context_tokens=300"],
     r"agent.max_context_tokens=300 is larger than model.config_overrides.max_position_embeddings=256"),
    (["agent.environment=calc", "reward.functions=[]", "agent.max_context_tokens=8"],
     r"rollout.max_new_tokens: 8 exceeds this run's limit 7 \(agent.max_context_tokens=8 .*less one prompt token"),
    (["agent.environment=calc", "reward.functions=[]", "agent.env_args=[1]"], r"agent.env_args: expected dict"),
    (["agent.environment=calc", "reward.functions=[]", "agent.env_args={1: hermes}"],
     r"agent.env_args: expected string keys, got int 1"),
])
def test_refused_at_load_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _check(overrides)


def test_per_token_gathering_on_two_ranks_is_refused():
    with pytest.raises(ConfigError, match="rollout.gather_params=false: with agent.environment on several ranks"):
        _check(["agent.environment=calc", "reward.functions=[]", "rollout.gather_params=false"], world_size=2)
    _check(["agent.environment=calc", "reward.functions=[]", "rollout.gather_params=false"], world_size=1)


@pytest.mark.slow
def test_a_user_environment_trains_and_its_failures_end_only_their_trajectories(tmp_path):
    """A user class from the user's own module; its resets raise, return garbage or hang for some rows: those
    trajectories end (env_error, env_timeout) as inert rows, the steps and validation run on."""
    run_train(str(tmp_path / "run"), ["agent.environment=parity_env:FlakyParityHint", "reward.functions=[]",
                                      *_data(tmp_path), "algo.adv_estimator=grpo", "rollout.n=2",
                                      "rollout.batch_size=8", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
                                      "agent.max_turns=3", "agent.max_context_tokens=48", "agent.step_timeout_s=0.5"],
              env=base_env(PYTHONPATH=os.path.dirname(parity_env.__file__) + os.pathsep + ROOT))  # the user's package
    rows = read_metrics(str(tmp_path / "run"))
    steps = [r for r in rows if "agent/turns/mean" in r]
    assert len(steps) == 2 and "val/score/mean" in rows[-1]
    assert sum(r["agent/end/env_error"] for r in steps) > 0 and sum(r["agent/end/env_timeout"] for r in steps) > 0
    for r in steps:
        assert r["agent/retokenization_mismatches"] == 0
        assert 0 <= r["agent/turns/mean"] <= 3 and 0 <= r["agent/truncated"] <= 1
        assert sum(r[f"agent/end/{k}"] for k in ("max_turns", "context", "turn_length", "env_error", "env_timeout",
                                                   "max_tool_calls")) == pytest.approx(r["agent/truncated"])
