"""verl_ds.plan and verl_ds.memory_plan: parameter counts from configs alone, memory by DeepSpeed's estimators (checked against
hand-computed figures), batch arithmetic and launch commands, and clear errors for bad arguments."""
import os
import re

import pytest

from launch_testutil import CONFIGS, QWEN25_05B, QWEN25_7B, ROOT, config_only_dir

from verl_ds.config import ConfigError, load_config, validate
from verl_ds.memory_plan import (ModelSize, estimate_memory, inference_engine_memory, model_size,
                                 trained_engine_memory)
from verl_ds.plan import launch_commands, plan

GPU_CONFIG = os.path.join(CONFIGS, "qwen2.5-0.5b-gsm8k.yaml")


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _qwen05_cfg(tmp_path, *overrides):
    return load_config(GPU_CONFIG, [f"model.path={config_only_dir(tmp_path / 'q05', **QWEN25_05B)}", *overrides])


def qwen2_params_by_hand(vocab, hidden, inter, layers, heads, kv_heads, tied):
    """Qwen2 parameter count term by term: q/k/v carry biases, o_proj and the MLP do not."""
    head_dim = hidden // heads
    attn = (hidden * hidden + hidden) + 2 * (hidden * kv_heads * head_dim + kv_heads * head_dim) + hidden * hidden
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden  # two RMSNorms
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def test_qwen25_05b_parameter_count_matches_the_hand_count(tmp_path):
    size = model_size(_qwen05_cfg(tmp_path), "actor")
    expected = qwen2_params_by_hand(151936, 896, 4864, 24, 14, 2, tied=True)
    assert expected == 494_032_768  # the published 0.49B
    assert size.total == expected
    assert size.largest_layer == 151936 * 896  # the (tied) embedding
    assert (size.vocab_size, size.hidden_size) == (151936, 896)
    critic = model_size(_qwen05_cfg(tmp_path), "critic")
    assert critic.total == expected + 896 + 1  # backbone (the tied head adds nothing) + value head


def test_untied_7b_counts_the_lm_head_for_the_actor_only(tmp_path):
    cfg = load_config(GPU_CONFIG, [f"model.path={config_only_dir(tmp_path / 'q7', **QWEN25_7B)}"])
    actor, critic = model_size(cfg, "actor"), model_size(cfg, "critic")
    assert actor.total == qwen2_params_by_hand(152064, 3584, 18944, 28, 28, 4, tied=False) == 7_615_616_512
    assert critic.total == actor.total - 152064 * 3584 + 3584 + 1


def test_tiny_config_count_equals_the_built_model(tmp_path):
    """The meta-device count against the trainer's own (real) tiny actor and critic."""
    from verl_ds.engines.build import build_actor_model, build_critic_model, load_tokenizer

    cfg = load_config(os.path.join(CONFIGS, "default.yaml"))
    tok = load_tokenizer(cfg)
    actor = build_actor_model(cfg, tok)
    critic = build_critic_model(cfg, tok, actor)
    assert model_size(cfg, "actor").total == sum(p.numel() for p in actor.parameters())
    assert model_size(cfg, "critic").total == sum(p.numel() for p in critic.parameters())


def test_critic_path_is_used_for_the_critic(tmp_path):
    cfg = _qwen05_cfg(tmp_path, f"model.critic_path={config_only_dir(tmp_path / 'q7', **QWEN25_7B)}")
    assert model_size(cfg, "actor").total == 494_032_768
    assert model_size(cfg, "critic").source == str(tmp_path / "q7")


P, L = 1_000_000_000, 100_000_000
SIZE = ModelSize(total=P, largest_layer=L, vocab_size=1000, hidden_size=1000, source="test")


@pytest.mark.parametrize("stage,off_opt,off_param,nodes,gpn,gpu,cpu", [
    # stage 3: 4 bytes x largest layer + 18 bytes x P / ranks; CPU (zero_init) = 4 x L x gpn x 1.5
    (3, False, False, 1, 8, 4 * L + 18 * P // 8, int(L * 4 * 8 * 1.5)),
    (3, False, False, 2, 8, 4 * L + 18 * P // 16, int(L * 4 * 8 * 1.5)),
    # optimizer offloaded: 2 bytes of 16-bit params stay per rank; CPU 16 x P / nodes x 1.5
    (3, True, False, 1, 8, 4 * L + 2 * P // 8, int(P * 16 * 1.5)),
    # params too: only the gathered layer on the GPU; CPU 18 x P / nodes x 1.5
    (3, True, True, 2, 8, 4 * L, int(P * 18 / 2 * 1.5)),
    # stage 2: 2 x P (16-bit params) + 18 x P / ranks
    (2, False, False, 1, 8, 2 * P + 18 * P // 8, int(P * 4 * 8 * 1.5)),
    (2, True, False, 1, 8, 2 * P, int(P * max(4 * 8, 16) * 1.5)),
    # stage 1: stage 2 plus the 16-bit gradients not partitioned
    (1, False, False, 1, 8, 2 * P + 18 * P // 8 + 2 * P - 2 * P // 8, int(P * 4 * 8 * 1.5)),
    # stage 0: nothing partitioned
    (0, False, False, 1, 8, 2 * P + 18 * P, int(P * 4 * 8 * 1.5)),
])
def test_trained_engine_memory_hand_computed(stage, off_opt, off_param, nodes, gpn, gpu, cpu):
    m = trained_engine_memory("actor", SIZE, stage, off_opt, off_param, nodes, gpn)
    assert m.gpu_bytes == gpu
    assert m.cpu_bytes_per_node == cpu


def test_trained_engine_memory_is_deepspeeds_estimator():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, L, num_gpus_per_node=4, num_nodes=3, cpu_offload=False,
                                                        cpu_offload_params=False, zero_init=True)
    m = trained_engine_memory("critic", SIZE, 3, False, False, 3, 4)
    assert (m.gpu_bytes, m.cpu_bytes_per_node) == (gpu, cpu)


def test_reference_memory_hand_computed():
    m = inference_engine_memory("ref", SIZE, 2, False, 1, 8)
    assert m.gpu_bytes == 2 * L + 2 * P // 8 and m.cpu_bytes_per_node == 0
    off = inference_engine_memory("ref", SIZE, 2, True, 2, 8)
    assert off.gpu_bytes == 2 * L and off.cpu_bytes_per_node == int(2 * P / 2 * 1.5)
    whole = inference_engine_memory("ref", SIZE, 2, False, 1, 8, zero_stage=0)  # an actor below ZeRO-3
    assert (whole.gpu_bytes, whole.cpu_bytes_per_node, whole.zero_stage) == (2 * P, 0, 0)


def test_estimate_memory_reads_stage_and_offload_from_the_generated_deepspeed_config(tmp_path):
    cfg = _qwen05_cfg(tmp_path, "deepspeed.zero_stage=2", "deepspeed.offload=[optimizer]")
    mem = estimate_memory(cfg, validate(cfg, 8), 1, 8)
    assert (mem["actor"].zero_stage, mem["actor"].offload_optimizer) == (2, True)
    assert (mem["ref"].zero_stage, mem["ref"].offload_optimizer) == (0, False)  # ZeRO-3 only with a ZeRO-3 actor
    p = 494_032_768
    assert mem["actor"].gpu_bytes == 2 * p
    assert mem["ref"].gpu_bytes == 2 * p  # unpartitioned: the whole bf16 model on every rank
    assert mem["rollout_replica"] == 2 * p  # bf16 replica for generate
    assert mem["logits"] == 4 * 2 * (256 + 256) * 151936
    # K and V x 24 layers x (2 kv heads x 64) x bf16 x 8 prompts per rank x (256 + 256) tokens
    assert mem["kv_cache"] == 2 * 24 * 128 * 2 * 8 * 512 == 50_331_648
    states = sum(mem[r].gpu_bytes for r in ("actor", "critic", "ref"))
    assert mem["steady"] == states + mem["rollout_replica"] + mem["kv_cache"]
    assert mem["need"] == states + 2 * p + max(mem["kv_cache"], mem["logits"])
    assert mem["startup_peak"] == 2 * (p + 896 + 1)  # stage 2: the critic (the larger) is built whole on every rank
    no_replica = estimate_memory(load_config(GPU_CONFIG, [f"model.path={cfg.model.path}", "rollout.gather_params=false"]),
                                 validate(cfg, 8), 1, 8)
    assert no_replica["rollout_replica"] == 0 and no_replica["kv_cache"] == mem["kv_cache"]
    zero3 = estimate_memory(_qwen05_cfg(tmp_path), validate(cfg, 8), 1, 8)
    assert zero3["startup_peak"] == 2 * 151936 * 896  # partitioned construction: one gathered layer (the embedding)


def test_plan_says_when_the_replica_does_not_fit_and_recommends_per_token_gathering(tmp_path):
    cfg = _qwen05_cfg(tmp_path)
    mem = estimate_memory(cfg, validate(cfg, 8), 1, 8)
    between = (mem["need"] + mem["need_without_replica"]) / 2 / 2**30
    tight = plan(cfg, 8, memory_gib=between)
    assert "does NOT fit" in tight
    assert re.search(r"recommended: rollout.gather_params=false .*, fits$", tight, re.M), tight
    assert "fits: " in plan(cfg, 8, memory_gib=1000)
    hopeless = plan(cfg, 8, memory_gib=0.01)
    assert "still does not fit" in hopeless and "deepspeed.offload" in hopeless
    lean = load_config(GPU_CONFIG, [f"model.path={cfg.model.path}", "rollout.gather_params=false"])
    assert "recommended" not in plan(lean, 8, memory_gib=0.01)
    with pytest.raises(ValueError, match=r"memory_gib: expected a positive number of GiB, got -1"):
        plan(cfg, 8, memory_gib=-1)


def test_plan_text_has_memory_batch_arithmetic_and_every_launcher(tmp_path):
    cfg = _qwen05_cfg(tmp_path)
    text = plan(cfg, 16, nodes=2, config_path="configs/qwen2.5-0.5b-gsm8k.yaml", overrides=["actor.lr=2e-6"])
    assert "2 node(s) x 8 rank(s) per node = world size 16" in text
    assert "494,032,768 parameters" in text
    for role in ("actor", "critic", "ref", "rollout replica", "total"):
        assert re.search(rf"^{role}\s", text, re.M), role
    assert "rollout.batch_size 64 prompts per step = 4 per rank x 16 rank(s)" in text
    assert "actor.mini_batch_size 32 = micro_batch_size 2 x grad_accum 1 x 16 rank(s)" in text
    for launcher in ("torchrun:", "deepspeed:", "accelerate:", "slurm:", "slurm+deepspeed:"):
        line = next(l for l in text.splitlines() if l.startswith(launcher))
        assert "launch/train.py --config configs/qwen2.5-0.5b-gsm8k.yaml actor.lr=2e-6" in line \
            or "slurm/train" in line and line.endswith("actor.lr=2e-6")
    assert "python:" not in text  # plain python is world size 1 only


def test_launch_commands_single_and_multi_node():
    one = launch_commands(1, 2, "configs/default.yaml", ["trainer.output_dir=runs/a b"])
    assert one["torchrun"] == "torchrun --standalone --nproc_per_node=2 launch/train.py --config configs/default.yaml " \
                              "'trainer.output_dir=runs/a b'"
    assert one["deepspeed"].startswith("deepspeed --num_gpus=2 --master_port=")
    assert "--num_processes=2" in one["accelerate"]
    assert "python" not in one
    multi = launch_commands(3, 4)
    assert "--nnodes=3 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR" in multi["torchrun"]
    assert "--hostfile=hostfile --num_nodes=3 --num_gpus=4" in multi["deepspeed"]
    assert "--num_processes=12 --num_machines=3 --machine_rank=$NODE_RANK" in multi["accelerate"]
    assert "sbatch --nodes=3 --ntasks-per-node=4 --gpus-per-node=4 slurm/train.sbatch" in multi["slurm"]
    assert "--ntasks-per-node=1" in multi["slurm+deepspeed"]
    assert launch_commands(1, 1)["python"] == "python launch/train.py --config configs/default.yaml"


def test_plan_for_cpu_jobs_names_the_cpu_accelerate_file():
    cfg = load_config(os.path.join(CONFIGS, "default.yaml"), ["trainer.device=cpu", "actor.micro_batch_size=8"])
    text = plan(cfg, 2)
    assert "configs/accelerate/deepspeed_zero3_cpu.yaml" in text and "per rank" in text


@pytest.mark.parametrize("args,match", [
    ((0,), r"world_size: expected an int >= 1, got 0"),
    ((2, 0), r"nodes: expected an int >= 1, got 0"),
    ((3, 2), r"world_size=3 is not divisible by nodes=2; pass gpus_per_node"),
    ((4, 1, 2), r"world_size=4 must equal nodes \* gpus_per_node = 1 \* 2 = 2"),
    ((2, 1, 2.0), r"gpus_per_node: expected an int >= 1, got 2.0"),
    ((True,), r"world_size: expected an int >= 1, got True"),
])
def test_bad_topology_is_a_clear_error(args, match):
    cfg = load_config(os.path.join(CONFIGS, "default.yaml"))
    with pytest.raises(ValueError, match=match):
        plan(cfg, *args)


def test_plan_validates_the_config_for_the_world_size():
    cfg = load_config(os.path.join(CONFIGS, "default.yaml"))
    plan(cfg, 2)  # the default job runs at world size 1 and 2 ...
    with pytest.raises(ConfigError, match=r"actor.micro_batch_size=16 must divide the per-rank mini-batch"):
        plan(cfg, 4)  # ... but 32 / 4 ranks = 8 per rank cannot hold a micro-batch of 16


def test_missing_or_broken_model_directory_is_named(tmp_path):
    cfg = load_config(GPU_CONFIG, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ValueError, match=r"model.path: '.*nope' is not a directory"):
        model_size(cfg)
    (tmp_path / "empty").mkdir()
    cfg = load_config(GPU_CONFIG, [f"model.path={tmp_path / 'empty'}"])
    with pytest.raises(ValueError, match=r"model.path: no usable config.json in '.*empty'"):
        model_size(cfg)
    with pytest.raises(ValueError, match=r"role: expected 'actor', 'ref' or 'critic', got 'reward'"):
        model_size(cfg, "reward")
