"""algo.kl_kind=full_symmetric (the exact full-vocabulary KL, computed from the LM heads in the actor's loss): accepted
in the loss, refused in the reward by name at start-up (exit 2) and in a hot update."""
import pytest

from verl_ds.cli import main
from verl_ds.config import ConfigError, load_config
from verl_ds.run.checks import check_config
from verl_ds.resolved_config import initial_state, kl_placement_of
from verl_ds.state import SharedState, StateValidationError


def test_accepted_in_the_loss_and_refused_in_the_reward_at_startup(capsys, tmp_path):
    cfg = load_config(None, ["algo.adv_estimator=grpo", "rollout.n=4", "algo.kl_kind=full_symmetric"])  # auto: loss
    check_config(cfg)
    assert initial_state(cfg)["kl_kind"] == "full_symmetric" and kl_placement_of(cfg) == "loss"
    with pytest.raises(ConfigError, match=r"algo.kl_kind: 'full_symmetric' .* can only be a loss term: set "
                                          r"algo.kl_placement=loss"):
        check_config(load_config(None, ["algo.kl_placement=reward", "algo.kl_kind=full_symmetric"]))
    status = main(["train", "algo.kl_kind=full_symmetric", f"trainer.output_dir={tmp_path}/run",
                   "trainer.total_steps=1", "trainer.loggers=[plot]"])  # gae: auto puts the KL in the reward
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("verl_ds: error:")]
    assert status == 2 and len(errors) == 1 and "algo.kl_kind: 'full_symmetric'" in errors[0], err


def test_a_hot_update_to_it_is_refused_when_the_kl_is_in_the_reward():
    state = SharedState.from_config(load_config(), rank=0)  # gae: the KL in the reward
    with pytest.raises(StateValidationError) as info:
        state.stage({"kl_kind": "full_symmetric"})
    assert "algo.kl_placement=loss" in info.value.errors["kl_kind"] and state.staged() == []
    in_loss = SharedState.from_config(load_config(None, ["algo.kl_placement=loss"]), rank=0)
    assert in_loss.stage({"kl_kind": "full_symmetric"})["staged"] == {"kl_kind": "full_symmetric"}
