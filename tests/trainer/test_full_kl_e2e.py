"""algo.kl_kind=full_symmetric through launch/train.py (GRPO, the KL in the loss, real DeepSpeed ZeRO-3): the exact
full-vocabulary KL is logged as actor/kl_loss; it is 0 at step 1, where the actor still equals the reference, and
positive once the actor has moved, of the size of the sampled symmetric estimate the KL controller sees. With a
LoRA actor the reference is its own engine with the adapters off."""
import pytest

from e2e_utils import read_metrics, run_train

pytestmark = pytest.mark.slow  # real training runs

GRPO = ["algo.adv_estimator=grpo", "rollout.n=4", "actor.mini_batch_size=32", "algo.kl_kind=full_symmetric",
        "algo.kl_coef=0.1", "trainer.total_steps=3", "trainer.val_every=0", "actor.lr=1e-2"]


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_full_symmetric_kl_in_a_grpo_run(tmp_path, variant):
    out = str(tmp_path / variant)
    extra = ["actor.lora_rank=4", "actor.lora_alpha=8"] if variant == "lora" else []
    run_train(out, [*GRPO, *extra], timeout=900)
    steps = [m for m in read_metrics(out) if "rollout/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    kl = [m["actor/kl_loss"] for m in steps]
    assert abs(kl[0]) < 1e-6, kl  # one mini-batch per step: step 1's update sees actor == reference
    for m, value in zip(steps[1:], kl[1:]):
        assert value > 1e-4, kl
        # the same divergence estimated from the sampled tokens alone (the symmetric estimator), before the update
        sampled = m["kl_ctrl/observed"]
        assert sampled / 3 < value < sampled * 3, (value, sampled)
