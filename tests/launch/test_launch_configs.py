"""Every file in configs/ loads, validates at the world sizes it is meant for, and yields DeepSpeed JSON;
the accelerate files parse with accelerate's own loader; the paths and names a config documents exist."""
import glob
import json
import os
import re

import pytest

from launch_testutil import CONFIGS, QWEN25_05B, QWEN25_7B, ROOT, config_only_dir, job_configs

from verl_ds.config import ConfigError, load_config, validate
from verl_ds.run.checks import check_config
from verl_ds.engines.ds_config import make_ds_config, merge_user_ds_config


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    # configs name their files relative to the repository root, where every launcher is started
    monkeypatch.chdir(ROOT)


def world_sizes(path: str) -> list[int]:
    """The world sizes a config's header declares ('Meant for world sizes 1, 2 or 4'); 1 when it says none."""
    with open(path, encoding="utf-8") as fh:
        header = "".join(line for line in fh if line.startswith("#"))
    m = re.search(r"[Mm]eant for world sizes? ([\d ,or]+)", header)
    return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else [1]


def test_the_shipped_configs_are_all_here():
    names = {os.path.basename(p) for p in job_configs()}
    assert {"default.yaml", "qwen2.5-0.5b-gsm8k.yaml", "grpo_gsm8k.yaml", "zero2.yaml", "zero3_offload.yaml",
            "agent_calc.yaml", "agent_calc_ppo.yaml", "agent_guess.yaml", "agent_qwen2.5_calc.yaml"} <= names


@pytest.mark.parametrize("path", job_configs(), ids=os.path.basename)
def test_config_validates_and_generates_deepspeed_json_at_its_world_sizes(path):
    sizes = world_sizes(path)
    cfg = load_config(path)
    for world in sizes:
        derived = check_config(cfg, world)
        assert derived.prompts_per_rank * world == cfg.rollout.batch_size
        for role in ("actor", "critic", "ref"):
            ds = make_ds_config(cfg, derived, role)
            json.dumps(ds)  # what deepspeed.initialize receives must be plain JSON
            assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
            assert ds["bf16"]["enabled"] == (cfg.model.dtype == "bf16")
            zero = ds["zero_optimization"]
            assert zero["stage"] == (cfg.deepspeed.zero_stage if role != "ref" or cfg.deepspeed.zero_stage == 3 else 0)
            assert ("offload_param" in zero) == cfg.deepspeed.offload_param
            if role != "ref":
                assert ("offload_optimizer" in zero) == (cfg.deepspeed.offload_optimizer and zero["stage"] > 0)


@pytest.mark.parametrize("path", job_configs(), ids=os.path.basename)
def test_config_files_and_reward_functions_it_names_exist(path):
    from verl_ds.rewards import resolve_reward_fn

    cfg = load_config(path)
    for key in ("train_files", "val_files"):
        f = getattr(cfg.data, key)
        assert f is None or os.path.exists(f), f"{os.path.basename(path)}: data.{key}={f!r} does not exist"
    for spec in cfg.reward.functions:
        resolve_reward_fn(spec if isinstance(spec, str) else spec["name"])
    if "exact_match" in cfg.reward.functions:
        assert "answer" in cfg.data.passthrough_keys, "exact_match needs data.passthrough_keys: [answer]"
    if cfg.data.train_files:
        with open(cfg.data.train_files, encoding="utf-8") as fh:
            row = json.loads(fh.readline())
        assert cfg.data.prompt_key in row and all(k in row for k in cfg.data.passthrough_keys)


def test_gpu_configs_point_at_a_local_model_and_say_how_to_get_it():
    for name in ("qwen2.5-0.5b-gsm8k.yaml", "grpo_gsm8k.yaml", "zero2.yaml", "zero3_offload.yaml",
                 "agent_qwen2.5_calc.yaml"):
        path = os.path.join(CONFIGS, name)
        cfg = load_config(path)
        assert cfg.model.path and not os.path.isabs(cfg.model.path)
        assert cfg.model.dtype == "bf16" and cfg.trainer.device == "cuda"
        if name != "zero2.yaml":  # zero2.yaml points at qwen2.5-0.5b-gsm8k.yaml's instructions
            assert "--local-dir " + cfg.model.path in open(path, encoding="utf-8").read()


def test_world_sizes_a_config_is_not_meant_for_fail_with_the_rule_named():
    cfg = load_config(os.path.join(CONFIGS, "qwen2.5-0.5b-gsm8k.yaml"))
    with pytest.raises(ConfigError, match=r"actor.micro_batch_size=2 must divide the per-rank mini-batch"):
        validate(cfg, 32)
    with pytest.raises(ConfigError, match=r"rollout.batch_size=64 must be divisible by the world size 3"):
        validate(cfg, 3)


def test_zero3_offload_overlay_is_applied_to_every_engine():
    cfg = load_config(os.path.join(CONFIGS, "zero3_offload.yaml"))
    assert cfg.deepspeed.config_file == "configs/deepspeed/zero3_offload.json"
    derived = validate(cfg, 8)
    for role in ("actor", "critic", "ref"):
        zero = make_ds_config(cfg, derived, role)["zero_optimization"]
        assert zero["overlap_comm"] is True and zero["offload_param"]["device"] == "cpu"
    assert make_ds_config(cfg, derived, "actor")["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "deepspeed", "*.json"))), ids=os.path.basename)
def test_deepspeed_overlays_merge_with_generated_configs(path):
    cfg = load_config(os.path.join(CONFIGS, "default.yaml"))
    derived = validate(cfg, 1)
    for role in ("actor", "critic", "ref"):
        merged = merge_user_ds_config(make_ds_config(cfg, derived, role), path)
        assert merged["train_batch_size"] == cfg.actor.micro_batch_size * (derived.grad_accum if role != "ref" else 1)


@pytest.mark.parametrize("name", ["deepspeed_zero3.yaml", "deepspeed_zero3_cpu.yaml"])
def test_accelerate_configs_parse_with_accelerates_loader(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    acc = load_config_from_file(os.path.join(CONFIGS, "accelerate", name))
    assert acc.distributed_type == DistributedType.DEEPSPEED
    ds = acc.deepspeed_config
    # verl_ds builds its models itself; zero.Init from accelerate would fight that
    assert ds["zero3_init_flag"] is False and ds["zero_stage"] == 3
    assert ds["offload_optimizer_device"] == "none" and ds["offload_param_device"] == "none"
    assert "deepspeed_config_file" not in ds  # beside mixed_precision it is a ValueError in accelerate
    assert acc.use_cpu == name.endswith("_cpu.yaml")
    assert acc.num_processes == (2 if acc.use_cpu else 8)


@pytest.mark.parametrize("path", job_configs(), ids=os.path.basename)
def test_plan_runs_for_every_config(path, tmp_path):
    from verl_ds.plan import plan

    overrides = []
    cfg = load_config(path)
    if cfg.model.path:
        arch = QWEN25_7B if "7B" in cfg.model.path else QWEN25_05B
        overrides = [f"model.path={config_only_dir(tmp_path / 'model', **arch)}"]
    cfg = load_config(path, overrides)
    for world in world_sizes(path):
        nodes = 2 if world >= 16 else 1
        text = plan(cfg, world, nodes=nodes, config_path=os.path.relpath(path, ROOT))
        assert f"world size {world}" in text and "slurm/train.sbatch" in text
