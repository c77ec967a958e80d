"""Keys removed from the schema: a config that still sets one is refused naming it and saying what to do instead
(exit 2 through the CLI), and what each key used to set is now decided as its REMOVED_KEYS entry says."""
import json

import pytest

from verl_ds.builder import build_reward
from verl_ds.cli import main
from verl_ds.config import ConfigError, iter_fields, load_config, validate
from verl_ds.config.schema import REMOVED_KEYS
from verl_ds.engines.ds_config import make_ds_config
from verl_ds.tokenizer import build_tokenizer

# each removed key, a value it used to take, and words its message must carry (what replaces it)
REMOVED = [
    ("deepspeed.stage3_max_live_parameters", "0", "zero_optimization.stage3_max_live_parameters in a deepspeed.config_file"),
    ("deepspeed.stage3_max_reuse_distance", "0", "zero_optimization.stage3_max_reuse_distance in a deepspeed.config_file"),
    ("deepspeed.stage3_prefetch_bucket_size", "0", "zero_optimization.stage3_prefetch_bucket_size in a deepspeed.config_file"),
    ("deepspeed.stage3_param_persistence_threshold", "0", "stage3_param_persistence_threshold in a deepspeed.config_file"),
    ("model.pad_is_eos", "true", "model.tokenizer_path"),
    ("reward.micro_batch_size", "8", "rollout.log_prob_micro_batch_size"),
    ("trainer.verify_checkpoint", "full", "trainer.checkpoint_digest=full"),
    ("server.max_body_bytes", "1024", "64 KiB"),
    ("model.cpu_linear", "auto", "F.linear"),
    ("deepspeed.grad_accumulation_fusion", "true", "autograd"),
    ("trainer.cpu_keep_freed_memory", "true", "MALLOC_MMAP_THRESHOLD_"),
]


def test_the_table_lists_exactly_the_keys_tested_here_and_none_that_exists():
    assert sorted(k for k, _, _ in REMOVED) == sorted(REMOVED_KEYS)
    assert not set(REMOVED_KEYS) & {dotted for dotted, *_ in iter_fields()}


@pytest.mark.parametrize("key, value, instead", REMOVED, ids=[k for k, _, _ in REMOVED])
def test_a_removed_key_is_refused_naming_it(tmp_path, key, value, instead):
    with pytest.raises(ConfigError, match=f"^{key}: this key was removed; ") as err:
        load_config(None, [f"{key}={value}"])
    assert instead in str(err.value)
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{key}: this key was removed; "):
        load_config(str(path))


def test_a_removed_key_exits_2_through_the_cli(capsys, tmp_path):
    status = main(["config", "server.max_body_bytes=1024"])
    err = capsys.readouterr().err
    assert status == 2 and "verl_ds: error: server.max_body_bytes: this key was removed" in err, err
    assert "Traceback" not in err


def test_an_unknown_key_still_gets_its_suggestions():
    with pytest.raises(ConfigError, match=r"unknown config key 'deepspeed.stage3_max_live' .*valid keys under deepspeed"):
        load_config(None, ["deepspeed.stage3_max_live=0"])


def test_zero3_keeps_deepspeeds_defaults_and_a_config_file_sets_them(tmp_path):
    """No stage3_* entry is generated (DeepSpeed's defaults apply: 1e9, 1e9, 5e7, 1e5); a config file's win."""
    cfg = load_config(None, ["deepspeed.zero_stage=3"])
    zero = make_ds_config(cfg, validate(cfg), "actor", gpu=False)["zero_optimization"]
    assert not [k for k in zero if k.startswith("stage3_")]
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    cfg = load_config(None, ["deepspeed.zero_stage=3", f"deepspeed.config_file={ds}"])
    assert make_ds_config(cfg, validate(cfg), "ref", gpu=False)["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_the_reward_models_forwards_take_the_no_grad_micro_batch():
    cfg = load_config(None, ["rollout.log_prob_micro_batch_size=5"])
    reward = build_reward(cfg, build_tokenizer(), validate(cfg))
    assert reward.micro_batch_size == 5
