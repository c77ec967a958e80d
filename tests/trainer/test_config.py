"""Config loading: YAML + overrides, type and range checks, batch arithmetic, the generated DeepSpeed JSON."""
import json

import pytest

from verl_ds.config import Config, ConfigError, describe, load_config, parse_override, validate
from verl_ds.engines.ds_config import make_ds_config, merge_user_ds_config
from verl_ds.run.checks import check_config
from verl_ds.resolved_config import registry_choices


def test_defaults_validate_and_derive():
    cfg = load_config()
    d = validate(cfg, world_size=2)
    assert d.prompts_per_rank == cfg.rollout.batch_size // 2
    assert d.mini_batch_per_rank == cfg.actor.mini_batch_size // 2
    assert d.grad_accum * cfg.actor.micro_batch_size == d.mini_batch_per_rank


def test_overrides_are_typed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("actor:\n  lr: 0.5\ntrainer:\n  total_steps: 3\n")
    cfg = load_config(str(p), ["actor.lr=1e-4", "trainer.seed=7", "algo.clip_ratio_c=null", "data.passthrough_keys=[answer]"])
    assert cfg.actor.lr == pytest.approx(1e-4) and cfg.trainer.total_steps == 3 and cfg.trainer.seed == 7
    assert cfg.algo.clip_ratio_c is None and cfg.data.passthrough_keys == ["answer"]


def test_group_estimators_validate_with_groups():
    d = validate(load_config(None, ["algo.adv_estimator=grpo", "rollout.n=4", "rollout.batch_size=8"]), world_size=2)
    assert d.samples_per_rank == 16 and d.mini_batches_per_epoch == 1  # 8 x 4 = 32 samples, one step of 32
    validate(load_config(None, ["algo.adv_estimator=reinforce_plus_plus"]))  # no groups needed


def test_parse_override():
    assert parse_override("a.b=1e-3") == ("a.b", 1e-3)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=even") == ("a.b", "even")
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        parse_override("actor.lr")


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1", r"unknown config key 'actor.lrr'; did you mean 'lr'"),
    ("actr.lr=1", r"unknown config key 'actr'; did you mean 'actor'"),
    ("actor.lr=abc", r"actor.lr: expected float, got str 'abc'"),
    ("actor.lr=-1.0", r"actor.lr: -1.0 is out of range \(0.0, 1.0\]"),
    ("trainer.total_steps=2.5", r"trainer.total_steps: expected int, got float 2.5"),
    ("trainer.total_steps=0", r"trainer.total_steps: 0 is out of range \[1, inf\)"),
    ("trainer.loggers=progress_bar", r"trainer.loggers: expected list, got str 'progress_bar'"),
    ("model.dtype=fp16", r"model.dtype: 'fp16' is not one of \['fp32', 'bf16'\]"),
    ("deepspeed.zero_stage=4", r"deepspeed.zero_stage: 4 is out of range \[0, 3\]"),
    ("rollout.top_p=1.5", r"rollout.top_p: 1.5 is out of range \(0.0, 1.0\]"),
    ("actor=3", r"actor: expected a mapping"),
])
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, world, message", [
    (["rollout.batch_size=30", "actor.mini_batch_size=16"], 1, r"actor.mini_batch_size=16 must divide rollout.batch_size=30"),
    (["rollout.batch_size=33", "actor.mini_batch_size=11", "actor.micro_batch_size=11"], 2, r"rollout.batch_size=33 must be divisible by the world size 2"),
    (["actor.micro_batch_size=3"], 1, r"actor.micro_batch_size=3 must divide the per-rank mini-batch"),
    (["algo.kl_kind=k4"], 1, r"algo.kl_kind: 'k4' is not one of \['auto', 'k1'"),
    (["algo.clip_ratio_c=0.5"], 1, r"algo.clip_ratio_c: 0.5 is out of range \(1.0, inf\)"),
    (["deepspeed.zero_stage=2", "deepspeed.offload=[param]"], 1, r"deepspeed.offload: param needs deepspeed.zero_stage=3"),
    (["model.config_overrides.hidden_size=63"], 1, r"model.config_overrides: hidden_size=63 must be divisible by num_attention_heads=4"),
    (["reward.functions=[]"], 1, r"configure at least one of reward.functions or reward.model_path"),
    (["reward.functions=[{weight: 2}]"], 1, r"reward.functions\[0\]: expected a name"),
    (["trainer.resume=/no/such/dir"], 1, r"trainer.resume: expected 'auto', 'none' or an existing checkpoint"),
    (["data.max_prompt_length=250", "rollout.max_new_tokens=10"], 1,
     r"rollout.max_new_tokens: 10 exceeds this run's limit 6 \(model.config_overrides.max_position_embeddings=256 - data.max_prompt_length=250"),
    (["data.max_prompt_length=256"], 1, r"data.max_prompt_length=256 leaves no room for a response"),
    (["rollout.batch_size=8", "rollout.n=3", "actor.mini_batch_size=16"], 1,
     r"actor.mini_batch_size=16 must divide rollout.batch_size \* rollout.n = 8 \* 3 = 24"),
    (["algo.kl_placement=loss", "algo.kl_kind=k1"], 1, r"algo.kl_kind: 'k1' in the loss .* regularises nothing"),
    (["algo.adv_estimator=grpo"], 1, r"rollout.n=1: algo.adv_estimator=grpo compares the responses .* Set rollout.n >= 2"),
    (["algo.adv_estimator=rloo", "rollout.n=1"], 1, r"rollout.n=1: algo.adv_estimator=rloo"),
    (["algo.clip_ratio_low=1.0"], 1, r"algo.clip_ratio_low: 1.0 is out of range \[0.0, 1.0\)"),
    (["algo.entropy_coef=2.0"], 1, r"algo.entropy_coef: 2.0 is out of range"),
    (["actor.lr=5.0"], 1, r"actor.lr: 5.0 is out of range"),
])
def test_inconsistent_configs_fail_before_building(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, overrides), world_size=world)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(str(lst))


def test_ds_config_is_derived_from_the_job_config():
    cfg = load_config(None, ["rollout.batch_size=32", "actor.mini_batch_size=16", "actor.micro_batch_size=4",
                             "deepspeed.offload=[optimizer]", "model.dtype=bf16"])
    d = validate(cfg, world_size=2)
    actor = make_ds_config(cfg, d, "actor", grad_clip=1.0)
    assert actor["train_micro_batch_size_per_gpu"] == 4 and actor["gradient_accumulation_steps"] == 2
    assert actor["train_batch_size"] == 16 and actor["zero_optimization"]["stage"] == 3
    assert actor["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert actor["bf16"]["enabled"] and actor["gradient_clipping"] == 1.0
    ref = make_ds_config(cfg, d, "ref")
    assert ref["zero_optimization"]["stage"] == 3 and "offload_optimizer" not in ref["zero_optimization"]
    # DeepSpeed's process-wide replacement of F.linear is off wherever ZeRO-3 builds a model on a CPU
    # (verl_ds.engines.cpu_speed); on a GPU DeepSpeed's default (on: it saves activation memory) stands
    assert ref["zero_optimization"]["memory_efficient_linear"] is False
    assert actor["zero_optimization"]["memory_efficient_linear"] is False
    for role in ("actor", "ref"):
        assert "memory_efficient_linear" not in make_ds_config(cfg, d, role, gpu=True)["zero_optimization"]
    cfg0 = load_config(None, ["deepspeed.zero_stage=0"])
    assert make_ds_config(cfg0, validate(cfg0), "critic")["zero_optimization"] == {"stage": 0}
    # the reference is partitioned only with a ZeRO-3 actor (DeepSpeed-Chat's rule): below it is stage 0
    for stage in (0, 1, 2):
        cfg_s = load_config(None, [f"deepspeed.zero_stage={stage}"])
        assert make_ds_config(cfg_s, validate(cfg_s), "ref")["zero_optimization"] == {"stage": 0}


def test_user_ds_config_merges_but_batch_sizes_stay_derived(tmp_path):
    cfg = load_config()
    d = validate(cfg)
    gen = make_ds_config(cfg, d, "actor")
    p = tmp_path / "ds.json"
    merged = merge_user_ds_config(gen, str(p), {"zero_optimization": {"reduce_bucket_size": 5}, "train_batch_size": "auto"})
    assert merged["zero_optimization"]["reduce_bucket_size"] == 5 and merged["zero_optimization"]["stage"] == 3
    assert merged["train_batch_size"] == gen["train_batch_size"]
    with pytest.raises(ValueError, match="train_batch_size=999 conflicts"):
        merge_user_ds_config(gen, str(p), {"train_batch_size": 999})
    with pytest.raises(ValueError, match="drop the 'optimizer' section"):
        merge_user_ds_config(gen, str(p), {"optimizer": {"type": "AdamW"}})
    p.write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="expected a JSON object"):
        merge_user_ds_config(gen, str(p))


def test_describe_lists_every_key():
    table = describe(registry_choices())
    for section in ("model", "data", "rollout", "actor", "critic", "algo", "reward", "deepspeed", "trainer", "server"):
        assert f"`{section}." in table
    assert table.count("\n") > 60
    assert isinstance(Config().to_yaml(), str)


def test_yaml_file_reads_scientific_notation_as_float(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("actor:\n  lr: 1e-3\ncritic:\n  lr: 5E-4\n")
    cfg = load_config(str(p))
    assert cfg.actor.lr == pytest.approx(1e-3) and cfg.critic.lr == pytest.approx(5e-4)


def test_docs_config_md_is_current():
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config.md")
    with open(path, encoding="utf-8") as fh:
        assert describe(registry_choices()) in fh.read(), "docs/config.md is stale: regenerate it with `verl-ds config --describe`"
