"""The default task is learned: PPO with a critic, GRPO (no critic) and PPO with a LoRA actor (no reference engine)
raise the train score by a clear margin within a CI-sized run (seeded, one rank, the default model)."""
import pytest

from e2e_utils import read_metrics, run_train

pytestmark = pytest.mark.slow  # real training runs / several processes

# the default job's model and batch sizes (configs/default.yaml), fewer steps
LEARN = ["trainer.loggers=[]", "trainer.export=none", "trainer.val_every=0",
         "trainer.resume=none", "data.num_val_prompts=8"]


def _rise(out: str, k: int) -> float:
    scores = [m["rollout/score/mean"] for m in read_metrics(out) if "rollout/score/mean" in m]
    return sum(scores[-k:]) / k - sum(scores[:k]) / k


@pytest.mark.parametrize("name, overrides, steps, margin", [
    ("ppo", [], 40, 0.15),
    ("grpo", ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=8", "actor.mini_batch_size=32"], 40,
     0.15),  # algo.kl_placement=auto: GRPO's KL term goes in the loss
    ("lora", ["actor.lora_rank=8", "actor.lr=2e-3"], 40, 0.15),  # the learning rate docs/config.md gives for LoRA
])
def test_the_default_task_is_learned(tmp_path, name, overrides, steps, margin):
    out = str(tmp_path / name)
    # the e2e helper's FAST overrides shrink the model; put the default job's sizes back
    run_train(out, [*LEARN, f"trainer.total_steps={steps}", "model.config_overrides.hidden_size=64", "model.config_overrides.intermediate_size=128",
                    "rollout.batch_size=32", "actor.mini_batch_size=32", "actor.micro_batch_size=16",
                    "rollout.max_new_tokens=8", "data.num_train_prompts=4096", *overrides], timeout=900)
    rise = _rise(out, k=5)
    assert rise > margin, f"{name}: the mean score of the last 5 steps rose by only {rise:.3f} over the first 5"
    if name == "grpo":  # no critic engine, no critic metrics; the KL in the loss, not in the rewards
        assert not any(k.startswith("critic/") for m in read_metrics(out) for k in m)
        assert all("actor/kl_loss" in m and "actor/reward_kl_penalty" not in m
                   for m in read_metrics(out) if "rollout/score/mean" in m)
