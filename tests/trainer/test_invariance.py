"""Invariance of one real update (DeepSpeed ZeRO-3 engines, fp32): the same global batch gives the same parameter
update however it is split into micro-batches, over 1 or 2 ranks, and with the torch or the Triton kernels; and the
first mini-batch of a real step is exactly on-policy."""
import os
import sys

import pytest
import torch

from e2e_utils import base_env, free_port, merged, read_metrics, run_group, run_train

pytestmark = pytest.mark.slow  # real training runs / several processes

PROBE = os.path.join(os.path.dirname(__file__), "update_probe.py")
# one mini-batch of 8 samples per update: the whole fixed batch; no clipping so the update is a pure function
BASE = ["rollout.batch_size=8", "actor.mini_batch_size=8", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
        "actor.grad_clip=0", "critic.grad_clip=0", "model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64",
        "data.num_train_prompts=64", "data.num_val_prompts=8", "trainer.loggers=[plot]", "algo.kl_coef=0.05",
        "algo.kl_ctrl=fixed", "trainer.resume=none"]


def _probe(root, name: str, overrides: list, nproc: int = 1, **env) -> dict:
    result = root / f"{name}.pt"
    args = [str(result), *merged([f"trainer.output_dir={root / name}"], BASE, overrides)]
    cmd = [sys.executable, PROBE, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         PROBE, *args]
    proc = run_group(cmd, env=base_env(**env), timeout=600)
    assert proc.returncode == 0, f"probe {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(result)


def _assert_same_update(a: dict, b: dict, rtol: float = 1e-5) -> None:
    """Each role's update (after - before, all its parameters as one vector) agrees to ``rtol`` in norm:
    ||dA - dB|| <= rtol ||dA||, and every single tensor's to 5 * rtol. (Adam's first step is lr * g / (|g| + eps)
    per element, so elements with |g| near eps amplify float noise of a different summation order.)"""
    assert ("critic" in a) == ("critic" in b)
    for role in [r for r in ("actor", "critic") if r in a]:
        assert a[role].keys() == b[role].keys()
        da = torch.cat([a[role][k].flatten() for k in sorted(a[role])])
        db = torch.cat([b[role][k].flatten() for k in sorted(a[role])])
        rel = float((da - db).norm() / da.norm())
        assert rel <= rtol, f"{role}: updates differ by {rel:.2e} (relative, in norm)"
        worst = max((float((a[role][k] - b[role][k]).norm() / a[role][k].norm().clamp(min=1e-30)), k) for k in a[role])
        assert worst[0] <= 5 * rtol, f"{role}.{worst[1]}: updates differ by {worst[0]:.2e} (relative, in norm)"
        assert all(float(a[role][k].norm()) > 0 for k in a[role]), f"{role}: a parameter did not move"


# the baseline: one rank, the whole mini-batch of 8 in one micro-batch, the torch kernels
ONE = ("one", ["actor.micro_batch_size=8"])


def test_micro_batch_split_does_not_change_the_update(probes):
    """1 x 8 and 8 x 1 micro-batches of one mini-batch: the exact global token mean makes them one update."""
    one = probes(*ONE, VERL_DS_KERNELS="torch")
    eight = probes("eight", ["actor.micro_batch_size=1"], VERL_DS_KERNELS="torch")
    _assert_same_update(one, eight)
    # one optimizer step each: the same global gradient; the loss metrics add up the micro-batches' shares (the
    # policy loss is ~0 here, ratio 1 with whitened advantages: the value loss is the one that would show 1/8)
    assert one["metrics"]["critic/vf_loss"] > 1e-3
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss"):
        assert one["metrics"][key] == pytest.approx(eight["metrics"][key], rel=1e-4, abs=1e-6), key


def test_one_rank_and_two_ranks_give_the_same_update(probes):
    """The same global batch on 1 rank and split over 2 ranks (4 samples each, in one micro-batch): DP-global
    whitening and the global token-mean normaliser make the update identical."""
    one = probes(*ONE, VERL_DS_KERNELS="torch")
    double = probes("double", ["actor.micro_batch_size=4"], nproc=2,
                    VERL_DS_KERNELS="torch")
    _assert_same_update(one, double)
    assert one["metrics"]["actor/grad_norm"] == pytest.approx(double["metrics"]["actor/grad_norm"], rel=1e-4)


def test_group_statistics_on_two_ranks_equal_one_rank(probes):
    """GRPO with 4 samples per prompt: a prompt's samples stay on one rank, so each rank's group means and stds (the
    advantages they give) equal a 1-rank run on the same prompts, with no collective for them."""
    grpo = ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=2", "algo.kl_placement=loss",
            "actor.micro_batch_size=4"]
    single = probes("grpo1", grpo)
    double = probes("grpo2", grpo, nproc=2)
    torch.testing.assert_close(double["advantages"], single["advantages"], rtol=0, atol=1e-6)
    assert "critic" not in single and single["advantages"].abs().sum() > 0


@pytest.mark.parametrize("prefixes", [True, False])
def test_shared_prompts_give_the_same_update(probes, prefixes):
    """GRPO with 4 samples per prompt in micro-batches of 4 (one group each): one copy of each prompt in the packed
    rows (model.share_prompts, the default), and of the response prefixes a group's samples have in common
    (model.share_response_prefixes, the default; the probe's j-th sample repeats the first j tokens of its group's
    first), gives the update, advantages and reference KL of the unshared rows."""
    grpo = ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=2", "algo.kl_placement=loss",
            "actor.micro_batch_size=4"]
    shared = probes("grpo1" if prefixes else "grpo1_prompts_only",
                    grpo if prefixes else [*grpo, "model.share_response_prefixes=false"])
    unshared = probes("grpo1_unshared", [*grpo, "model.share_prompts=false"])
    assert shared["share_prompts"] and not unshared["share_prompts"] and shared["share_prefixes"] == prefixes
    tokens = shared["packed_tokens"]
    assert tokens[True] < tokens[False], tokens  # the batch has prefixes to share
    torch.testing.assert_close(shared["advantages"], unshared["advantages"], rtol=0, atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert shared["metrics"][key] == pytest.approx(unshared["metrics"][key], rel=1e-5, abs=1e-7), key
    # the same gradient (its norm above) summed in another order: the prompt's share arrives through one copy, not
    # four; Adam's first step (about lr * sign(g)) turns that float noise into 2.6e-5 here, hence 1e-4
    _assert_same_update(shared, unshared, rtol=1e-4)


@pytest.mark.parametrize("tokens", [200, 12])
def test_token_budget_with_shared_prompts_gives_the_same_update(probes, tokens):
    """GRPO micro-batches formed by a token budget (a prompt counted once, its samples kept together while they fit,
    cut into pieces when they do not) give the update of fixed micro-batches of one group each: 200 tokens hold both
    groups, 12 tokens cut them."""
    grpo = ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=2", "algo.kl_placement=loss",
            "actor.micro_batch_size=4"]
    fixed = probes("grpo1", grpo)
    budget = probes(f"grpo1_budget{tokens}", [*grpo, f"actor.max_tokens_per_micro_batch={tokens}"])
    assert budget["share_prompts"] and fixed["micro_batches"] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    (groups,) = budget["micro_batches"]  # one mini-batch; its rows 4g..4g+3 are one prompt's samples
    if tokens == 200:
        assert groups == [list(range(8))]
    else:
        assert len(groups) > 2 and all(g == list(range(g[0], g[-1] + 1)) for g in groups), groups
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert budget["metrics"][key] == pytest.approx(fixed["metrics"][key], rel=1e-5, abs=1e-7), key
    _assert_same_update(budget, fixed, rtol=1e-4)


def test_torch_and_triton_kernels_give_the_same_update(probes):
    """The log-prob kernels through Triton's interpreter and through torch: the same losses and update."""
    torch_run = probes(*ONE, VERL_DS_KERNELS="torch")
    triton_run = probes("triton", ONE[1], VERL_DS_KERNELS="triton", TRITON_INTERPRET="1")
    _assert_same_update(torch_run, triton_run)
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy"):
        assert triton_run["metrics"][key] == pytest.approx(torch_run["metrics"][key], rel=1e-5, abs=1e-7), key


def test_first_mini_batch_is_on_policy_with_temperature_and_dropout_in_the_config(tmp_path):
    """A real step at temperature 0.7 with a checkpoint whose config sets dropout 0.1 everywhere: the first (here the
    only) mini-batch has ratio 1 exactly, so sampling and scoring agree (temperature, dropout, replica weights,
    generation config)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from verl_ds.tasks import parity
    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer(parity.VOCAB)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      attention_dropout=0.1, hidden_dropout=0.1, mlp_dropout=0.1)
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    run_train(str(out), [f"model.path={model_dir}", "trainer.total_steps=1", "rollout.temperature=0.7",
                         "rollout.batch_size=8", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
                         "actor.ppo_epochs=1", "trainer.export=none", "data.max_prompt_length=16"])
    step = [m for m in read_metrics(str(out)) if m["step"] == 1][0]
    assert step["actor/ppo_kl"] < 1e-6, step["actor/ppo_kl"]
    assert step["actor/pg_clipfrac"] == 0.0
    assert step["rollout/log_prob_diff_mean"] < 1e-4  # the sampler's own log-probs agree with the recomputation


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_multi_turn_batch_on_two_ranks_equals_one_rank(probes, estimator):
    """A fixed batch of multi-turn trajectories (model turns with environment answers between them: attended, not
    trained): split over 2 ranks, the advantages and the update equal one rank's, with a critic (GAE bridging the
    environment's spans) and with GRPO's group statistics."""
    turns = ["rollout.n=4", "rollout.batch_size=2", "actor.micro_batch_size=4"] + (
        ["algo.adv_estimator=grpo", "algo.kl_placement=loss"] if estimator == "grpo" else [])
    single = probes(f"turns1_{estimator}", turns, VERL_DS_PROBE_TURNS="1", VERL_DS_KERNELS="torch")
    double = probes(f"turns2_{estimator}", turns, nproc=2, VERL_DS_PROBE_TURNS="1", VERL_DS_KERNELS="torch")
    torch.testing.assert_close(double["advantages"], single["advantages"], rtol=0, atol=1e-6)
    assert single["advantages"].abs().sum() > 0
    _assert_same_update(single, double)


def test_multi_turn_packed_rows_give_the_padded_update(probes):
    """The multi-turn batch in packed rows with shared prompts (the defaults) gives the update of padded rows: the
    environment's tokens are attended alike and trained in neither."""
    turns = ["rollout.n=4", "rollout.batch_size=2", "actor.micro_batch_size=4", "algo.adv_estimator=grpo",
             "algo.kl_placement=loss"]
    packed = probes("turns1_grpo", turns, VERL_DS_PROBE_TURNS="1",
                    VERL_DS_KERNELS="torch")
    padded = probes("turns1_grpo_padded", [*turns, "model.remove_padding=false"],
                    VERL_DS_PROBE_TURNS="1", VERL_DS_KERNELS="torch")
    assert packed["share_prompts"]
    torch.testing.assert_close(packed["advantages"], padded["advantages"], rtol=0, atol=1e-6)
    _assert_same_update(packed, padded, rtol=1e-4)
