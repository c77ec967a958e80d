"""One real update (DeepSpeed ZeRO-3 engines, fp32) with model.sequence_parallel_size=2 on 2 ranks (one
sequence-parallel group: each packed row split over both ranks, each rank's micro-batches in turn) equals the update
of the same global batch on 1 rank: PPO (actor, critic, reference) and GRPO. This checks the gradient scaling end to
end: DeepSpeed averages over every rank, the group's ranks each backpropagate every turn's loss."""
import pytest

from test_invariance import ONE, _assert_same_update  # the probes fixture: conftest.py

pytestmark = pytest.mark.slow  # several processes

def _assert_split(result: dict) -> None:
    """Every packed row of the run went through the all-to-all attention, each rank holding half its tokens."""
    assert result["actor_attention"] == "verl_ds_ulysses__verl_ds_varlen_sdpa"
    assert result["split_rows"] and all(2 * local == tokens for local, tokens in result["split_rows"])


SP2 = ["model.sequence_parallel_size=2", "actor.micro_batch_size=2"]


def test_ppo_update_with_sequence_parallel_equals_one_rank(probes):
    one = probes(*ONE, VERL_DS_KERNELS="torch")
    split = probes("sp2", SP2, nproc=2, VERL_DS_KERNELS="torch")
    _assert_same_update(one, split)
    _assert_split(split)
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss"):
        assert one["metrics"][key] == pytest.approx(split["metrics"][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("micro", [[], ["actor.max_tokens_per_micro_batch=40"]], ids=["rows", "token_budget"])
def test_grpo_update_with_sequence_parallel_equals_one_rank(probes, micro):
    """GRPO with shared prompts (rollout.n=2), micro-batches of 2 rows or by a token budget."""
    grpo = ["algo.adv_estimator=grpo", "rollout.n=2"]
    one = probes("grpo_one", grpo + ["actor.micro_batch_size=8"], VERL_DS_KERNELS="torch")
    split = probes(f"grpo_sp2{len(micro)}", grpo + SP2 + micro, nproc=2, VERL_DS_KERNELS="torch")
    _assert_same_update(one, split)
    _assert_split(split)
    assert split["share_prompts"]
    for key in ("actor/grad_norm", "actor/pg_loss"):
        assert one["metrics"][key] == pytest.approx(split["metrics"][key], rel=1e-4, abs=1e-6), key


def test_lora_update_with_sequence_parallel_equals_one_rank(probes):
    """LoRA actor and critic (the reference is the actor with its adapters off): the adapters' update is the same."""
    lora = ["actor.lora_rank=4", "actor.lora_alpha=8", "critic.lora_rank=2"]
    one = probes("lora_one", lora + ONE[1], VERL_DS_KERNELS="torch")
    split = probes("lora_sp2", lora + SP2, nproc=2, VERL_DS_KERNELS="torch")
    _assert_split(split)

    # what moves in one step: adapters (LoRA's B starts at 0, so A gets no gradient yet) and the value head; the
    # same tensors in both runs, the frozen base in neither
    moved = {role: [k for k, v in one[role].items() if float(v.norm()) > 0] for role in ("actor", "critic")}
    assert all(any("lora_" in k for k in keys) for keys in moved.values()), moved
    for role, keys in moved.items():
        assert keys == [k for k, v in split[role].items() if float(v.norm()) > 0], role
    _assert_same_update(*({role: {k: r[role][k] for k in keys} for role, keys in moved.items()} for r in (one, split)))
