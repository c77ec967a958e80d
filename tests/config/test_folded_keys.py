"""Keys folded into others (issue 32): each old key is refused naming its replacement (exit 2 through the CLI,
from the command line and from a YAML file), and the replacement, written as the message says, sets what the old
key set: the built model's shape, the loggers, the offload entries, the generation's sharing, the critic's LoRA."""
import re

import pytest
import torch

from verl_ds.cli import main
from verl_ds.config import ConfigError, iter_fields, load_config, validate
from verl_ds.config.folded import FOLDED_KEYS
from verl_ds.engines.ds_config import make_ds_config
from verl_ds.weights.lora import lora_spec
from verl_ds.memory_plan import model_size
from verl_ds.rollout_engines import build_rollout_engine

# each folded key, a value it used to take, and the replacement its message must spell out for that value
FOLDED = [
    ("model.hidden_size", "128", "model.config_overrides.hidden_size=128"),
    ("model.intermediate_size", "256", "model.config_overrides.intermediate_size=256"),
    ("model.num_layers", "3", "model.config_overrides.num_hidden_layers=3"),
    ("model.num_heads", "8", "model.config_overrides.num_attention_heads=8"),
    ("model.num_kv_heads", "1", "model.config_overrides.num_key_value_heads=1"),
    ("model.max_position_embeddings", "512", "model.config_overrides.max_position_embeddings=512"),
    ("trainer.progress_bar", "false", "leave progress_bar out of trainer.loggers"),
    ("trainer.plot", "false", "leave plot out of trainer.loggers"),
    ("trainer.tensorboard", "true", "list tensorboard in trainer.loggers"),
    ("trainer.wandb", "true", "list wandb in trainer.loggers"),
    ("critic.lora_alpha", "8", "actor.lora_alpha"),
    ("critic.lora_dropout", "0.1", "actor.lora_dropout"),
    ("critic.lora_target_modules", "[q_proj]", "actor.lora_target_modules"),
    ("critic.micro_batch_size", "8", "actor.micro_batch_size"),
    ("critic.max_tokens_per_micro_batch", "512", "actor.max_tokens_per_micro_batch"),
    ("trainer.export_hf", "false", "trainer.export=none"),
    ("trainer.export_format", "adapter", "trainer.export='adapter'"),
    ("deepspeed.offload_optimizer", "true", "list optimizer in deepspeed.offload"),
    ("deepspeed.offload_param", "true", "list param in deepspeed.offload"),
    ("rollout.share_prefill", "false", "rollout.share=none"),
    ("rollout.share_decode", "false", "rollout.share=prefill"),
]


def test_the_table_lists_exactly_the_keys_tested_here_and_none_that_exists():
    assert sorted(k for k, _, _ in FOLDED) == sorted(FOLDED_KEYS)
    assert not set(FOLDED_KEYS) & {dotted for dotted, *_ in iter_fields()}
    assert {new for new, _ in FOLDED_KEYS.values()} <= {dotted for dotted, *_ in iter_fields()}


def test_at_most_138_keys():
    # the budget of 125, plus the sandbox's opt-out, the math_verify timeout, the completion limits of the SFT,
    # reward-model and DPO jobs (sft/rm/dpo.max_completion_length, which no longer borrow rollout.max_new_tokens),
    # the policy-loss choice with SAPO's two temperatures, the mismatch band's lower bound and rejection criteria
    # (rollout.is_low, is_rejection) and on-policy distillation (distill.teacher_path, coef, mode)
    assert len(list(iter_fields())) <= 138


@pytest.mark.parametrize("key, value, instead", FOLDED, ids=[k for k, _, _ in FOLDED])
def test_a_folded_key_is_refused_naming_its_replacement(tmp_path, key, value, instead):
    new = FOLDED_KEYS[key][0]
    with pytest.raises(ConfigError, match=f"^{re.escape(key)} was folded into {re.escape(new)}: use ") as err:
        load_config(None, [f"{key}={value}"])
    assert instead in str(err.value)
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(key)} was folded into {re.escape(new)}: use "):
        load_config(str(path))


def test_a_folded_key_exits_2_through_the_cli(capsys):
    status = main(["config", "model.hidden_size=128"])
    err = capsys.readouterr().err
    assert status == 2 and ("verl_ds: error: model.hidden_size was folded into model.config_overrides: use "
                            "model.config_overrides.hidden_size=128") in err, err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------- config_overrides


def test_config_overrides_shape_the_built_model():
    cfg = load_config(None, ["model.config_overrides.hidden_size=96", "model.config_overrides.num_hidden_layers=3",
                             "model.config_overrides.num_attention_heads=6",
                             "model.config_overrides.num_key_value_heads=2", "model.config_overrides.intermediate_size=160"])
    validate(cfg)
    size = model_size(cfg, "actor")
    assert (size.hidden_size, size.num_layers, size.kv_dim) == (96, 3, 2 * 96 // 6)
    # Llama decoder layer by hand: q, o (h x h); k, v (h x kv); gate, up, down (h x i); two RMSNorms (h each)
    h, kv, i, vocab = 96, 32, 160, size.vocab_size
    assert size.total == 3 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * vocab * h + h  # untied head, final norm


def test_yaml_and_command_line_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  config_overrides:\n    hidden_size: 32\n    intermediate_size: 64\n")
    cfg = load_config(str(path), ["model.config_overrides.num_hidden_layers=1"])
    assert cfg.model.config_overrides == {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    assert model_size(cfg).num_layers == 1


@pytest.mark.parametrize("overrides, message", [
    (["model.config_overrides.hiden_size=32"], r"model.config_overrides.hiden_size: not a field of LlamaConfig "
                                               r"\(model.arch=llama\); did you mean 'hidden_size'"),
    (["model.arch=qwen2", "model.config_overrides.mlp_bias=true"], r"model.config_overrides.mlp_bias: not a field "
                                                                    r"of Qwen2Config"),
    (["model.config_overrides.hidden_size=64.0"], r"model.config_overrides.hidden_size: expected int .* got float"),
    (["model.config_overrides.vocab_size=10"], r"model.config_overrides.vocab_size: set from the tokenizer"),
    (["model.config_overrides.num_hidden_layers=0"], r"model.config_overrides.num_hidden_layers: 0 is out of range"),
    (["model.config_overrides.hidden_size=36", "model.config_overrides.num_attention_heads=8"],
     r"model.config_overrides: hidden_size=36 must be divisible by num_attention_heads=8"),
    (["model.config_overrides.num_attention_heads=4", "model.config_overrides.num_key_value_heads=3"],
     r"model.config_overrides: num_attention_heads=4 must be divisible by num_key_value_heads=3"),
    (["model.path=/tmp", "model.config_overrides.hidden_size=32"], r"model.config_overrides: .* model.path='/tmp' "
                                                                   r"is set"),
])
def test_bad_config_overrides_exit_2_naming_the_field(capsys, overrides, message):
    assert main(["config", "--check", *overrides]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_qwen2_fields_are_accepted_for_qwen2():
    cfg = load_config(None, ["model.arch=qwen2", "model.config_overrides.use_sliding_window=true",
                             "model.config_overrides.sliding_window=16"])
    validate(cfg)


# ------------------------------------------------------------------------------------------------- the rest


def test_loggers_take_a_fixed_set(capsys):
    assert load_config(None, ["trainer.loggers=[wandb, progress_bar]"]).trainer.loggers == ["wandb", "progress_bar"]
    assert load_config().trainer.loggers == ["progress_bar", "plot"]  # what the four bools' defaults were
    assert main(["config", "trainer.loggers=[progress_bar, console]"]) == 2
    assert ("trainer.loggers[1]: 'console' is not one of ['progress_bar', 'plot', 'tensorboard', 'wandb']"
            in capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"trainer.loggers: lists \['plot', 'plot'\]: expected each value once"):
        load_config(None, ["trainer.loggers=[plot, plot]"])


@pytest.mark.parametrize("offload, optimizer, param", [("[]", False, False), ("[optimizer]", True, False),
                                                       ("[param]", False, True), ("[param, optimizer]", True, True)])
def test_offload_list_sets_the_deepspeed_entries(offload, optimizer, param):
    cfg = load_config(None, [f"deepspeed.offload={offload}"])
    zero = make_ds_config(cfg, validate(cfg), "actor", gpu=False)["zero_optimization"]
    assert ("offload_optimizer" in zero, "offload_param" in zero) == (optimizer, param)
    with pytest.raises(ConfigError, match=r"deepspeed.offload\[0\]: 'params' is not one of \['optimizer', 'param'\]"):
        load_config(None, ["deepspeed.offload=[params]"])


@pytest.mark.parametrize("share, prefill, decode", [("decode", True, True), ("prefill", True, False),
                                                    ("none", False, False)])
def test_rollout_share_sets_the_hf_engine(share, prefill, decode):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_config(None, [f"rollout.share={share}"])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).to(torch.float32)
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1})()
    engine = build_rollout_engine(cfg, model, tok)
    assert (engine.share_prefill, engine.share_decode) == (prefill, decode)


def test_export_replaces_export_hf_and_export_format(capsys):
    assert [load_config(None, [f"trainer.export={v}"]).trainer.export for v in ("merged", "adapter", "none")] == [
        "merged", "adapter", "none"]
    assert main(["config", "trainer.export=false"]) == 2  # YAML's false is not a choice
    assert "trainer.export: expected str, got bool False" in capsys.readouterr().err


def test_the_critic_lora_takes_the_actors_arguments():
    cfg = load_config(None, ["critic.lora_rank=2", "actor.lora_alpha=4", "actor.lora_target_modules=[q_proj, output-head]"])
    s = lora_spec(cfg, "critic")
    assert (s.rank, s.alpha, s.scaling, s.target_modules) == (2, 4.0, 2.0, ("q_proj",))


def test_a_config_files_overrides_with_model_path_are_refused_and_can_be_dropped(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  config_overrides: {hidden_size: 128}\n")
    assert main(["config", "--config", str(path), f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.config_overrides: {'hidden_size': 128} shapes the model built from config" in err
    assert "model.config_overrides={} drops a config file's" in err
    main(["config", "--config", str(path), f"model.path={tmp_path}", "model.config_overrides={}"])
    assert "model.config_overrides" not in capsys.readouterr().err  # refused later, for the empty model directory
