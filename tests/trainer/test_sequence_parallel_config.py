"""model.sequence_parallel_size refusals: each names the key, before any model is built where the config tells
(exit 2 through the CLI), else when the built models show it (a family whose attention cannot be split)."""
import json
import os
import sys

import pytest

from verl_ds.cli import main
from verl_ds.config import ConfigError, load_config, validate
from verl_ds.run.startup import check_startup

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


def test_world_not_divisible_by_the_degree_exits_2_naming_the_key(capsys):
    assert main(["config", "--check", "--world-size", "3", "model.sequence_parallel_size=2",
                 "rollout.batch_size=48", "actor.mini_batch_size=48", "actor.micro_batch_size=16"]) == 2
    err = capsys.readouterr().err
    assert "model.sequence_parallel_size=2 must divide the world size 3" in err


@pytest.mark.parametrize("overrides, message", [
    (["model.config_overrides.num_attention_heads=6", "model.config_overrides.num_key_value_heads=3", "model.config_overrides.hidden_size=96"],
     r"model.sequence_parallel_size=2 must divide num_attention_heads=6 and num_key_value_heads=3 \(of model.config_overrides\)"),
    (["model.config_overrides.num_key_value_heads=1"],
     r"model.sequence_parallel_size=2 must divide num_attention_heads=4 and num_key_value_heads=1 \(of model.config_overrides\)"),
    (["model.remove_padding=false"],
     r"model.sequence_parallel_size=2 splits packed rows: it needs model.remove_padding=true"),
])
def test_heads_and_padded_batches_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["model.sequence_parallel_size=2", *overrides]), world_size=2)


def test_degree_that_fits_validates():
    validate(load_config(None, ["model.sequence_parallel_size=2"]), world_size=2)
    validate(load_config(None, ["model.sequence_parallel_size=4", "model.config_overrides.num_attention_heads=8", "model.config_overrides.num_key_value_heads=4",
                                "model.config_overrides.hidden_size=64", "actor.micro_batch_size=4"]), world_size=4)


def test_heads_of_a_model_on_disk_are_checked_at_start_up(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 14,
                                                   "num_key_value_heads": 2}))
    (model / "tokenizer.json").write_text("{}")
    cfg = load_config(None, [f"model.path={model}", "model.sequence_parallel_size=4", "actor.micro_batch_size=4",
                             f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"model.sequence_parallel_size=4 must divide the attention heads \(14\) and "
                                          r"the key/value heads \(2\) of model.path="):
        check_startup(cfg, world_size=4)


def test_a_family_whose_attention_cannot_be_split_is_refused_naming_the_key():
    """Bloom has its own attention code (no transformers AttentionInterface dispatch): nothing to wrap."""
    from families_testutil import tiny_family_lm

    from verl_ds.models.sequence_parallel import setup_sequence_parallel

    with pytest.raises(ConfigError, match=r"model.sequence_parallel_size=2: the actor \(bloom \(BloomForCausalLM\)\) "
                                          r"cannot be split"):
        setup_sequence_parallel(2, {"actor": tiny_family_lm("bloom")}, packed=True)


def test_padded_batches_after_a_packing_fall_back_are_refused_naming_the_key():
    from families_testutil import tiny_family_lm

    from verl_ds.models.sequence_parallel import setup_sequence_parallel

    with pytest.raises(ConfigError, match=r"model.sequence_parallel_size=2 splits packed rows, but these models "
                                          r"score padded batches"):
        setup_sequence_parallel(2, {"actor": tiny_family_lm("llama")}, packed=False)


def test_heads_of_a_built_model_are_checked_before_any_group_is_made():
    from families_testutil import tiny_family_lm

    from verl_ds.models.sequence_parallel import setup_sequence_parallel

    lm = tiny_family_lm("llama", num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"model.sequence_parallel_size=2 must divide the attention heads \(4\) and "
                                          r"the key/value heads \(1\).*\(actor: llama"):
        setup_sequence_parallel(2, {"actor": lm}, packed=True)


def test_plan_counts_activations_per_rank_with_the_degree(capsys):
    """Default tiny model: a micro-batch of 16 x 24 tokens, 2 layers of hidden 64 in fp32: 34 * 64 * 2 bytes per
    token and layer (arXiv:2205.05198 at 16 bits, doubled) = 4352; x 2 layers x 384 tokens = 3.19 MiB on one rank,
    x 192 tokens = 1.59 MiB when a group of 2 splits the row."""
    assert main(["plan", "--world-size", "2"]) == 0
    assert "activations of one actor micro-batch: 384 tokens per GPU, 2 layers x hidden 64: about 3.19 MiB" in \
        capsys.readouterr().out
    assert main(["plan", "--world-size", "2", "model.sequence_parallel_size=2"]) == 0
    assert ("activations of one actor micro-batch: 192 tokens per GPU / model.sequence_parallel_size 2, 2 layers x "
            "hidden 64: about 1.59 MiB") in capsys.readouterr().out
