"""``verl-ds plan``: per-rank memory, whether it fits, the batch arithmetic and every launcher's command line, before
anything is launched (docs/launch.md, "Before launching")."""
from __future__ import annotations

import re
import shlex
from typing import Optional, Sequence

from verl_ds.config import Config, sequence_tokens
from verl_ds.memory_plan import GiB, device_memory, estimate_memory, model_size
from verl_ds.run.checks import check_config

# Used on the command lines; each launcher has its own default (29500), which collides between jobs.
DEFAULT_PORT = 29500


def fit_advice(cfg: Config, mem: dict, capacity: Optional[int], unit: str) -> list:
    """Lines saying whether the busiest moment fits ``capacity`` and what to change when it does not."""
    need, lean = mem["need"], mem["need_without_replica"]
    if cfg.rollout.engine == "vllm":
        return _vllm_fit_advice(cfg, mem, capacity, unit)
    if capacity is None:
        lines = [f"busiest moment: {_fmt(need)} per {unit} (states + replica + max(KV cache, logits)); device "
                 "memory unknown: pass it (plan(memory_gib=...)) for a verdict"]
        if cfg.rollout.gather_params:
            lines.append(f"  without the replica (rollout.gather_params=false): {_fmt(lean)} per {unit}")
        return lines
    if need <= capacity:
        return [f"fits: {_fmt(need)} of {_fmt(capacity)} per {unit} at the busiest moment (before activations)"]
    lines = [f"does NOT fit: {_fmt(need)} needed, {_fmt(capacity)} per {unit}"]
    if cfg.rollout.gather_params:
        verdict = "fits" if lean <= capacity else "still does not fit"
        lines.append(f"  recommended: rollout.gather_params=false (generate with per-token ZeRO-3 gathering, no "
                     f"replica): {_fmt(lean)} per {unit}, {verdict}")
    if lean > capacity:
        lines.append("  also consider: deepspeed.offload=[optimizer] or [optimizer,param], more ranks, a smaller "
                     "rollout.batch_size or data.max_prompt_length")
    return lines


def _vllm_fit_advice(cfg: Config, mem: dict, capacity: Optional[int], unit: str) -> list:
    frac, need = mem.get("vllm_fraction"), mem["need"]
    what = "states + vLLM weights and KV cache + logits"
    if frac is not None:
        what = f"states + logits, plus vLLM's rollout.vllm_gpu_memory_utilization={frac} of the GPU"
        if capacity is not None:  # asleep during the update, vLLM's share and the logits never meet
            vllm, logits = int(frac * capacity), mem["logits"]
            need = mem["states"] + (max(vllm, logits) if cfg.rollout.vllm_sleep else vllm + logits)
    if capacity is None:
        return [f"busiest moment: {_fmt(need)} per {unit} ({what}); device memory unknown: pass it "
                "(plan(memory_gib=...)) for a verdict"]
    if need <= capacity:
        return [f"fits: {_fmt(need)} of {_fmt(capacity)} per {unit} at the busiest moment ({what}, before "
                "activations)"]
    lines = [f"does NOT fit: {_fmt(need)} needed ({what}), {_fmt(capacity)} per {unit}"]
    if not cfg.rollout.vllm_sleep and unit == "GPU":
        lines.append("  consider: rollout.vllm_sleep=true (vLLM's weights and cache leave the GPU during the update)")
    lines.append("  consider: a smaller rollout.vllm_kv_cache_bytes or vllm_gpu_memory_utilization, "
                 "rollout.vllm_dtype=bf16, or rollout.engine=hf with rollout.gather_params=false")
    return lines


def _join(parts: Sequence[str]) -> str:
    # $NODE_RANK-style placeholders stay unquoted so the shell on each node expands them
    return " ".join(p if re.fullmatch(r"[\w@%+=:,./$-]+", p) else shlex.quote(p) for p in parts)


def launch_commands(nodes: int, gpus_per_node: int, config_path: str = "configs/default.yaml",
                    overrides: Sequence[str] = (), accelerate_config: str = "configs/accelerate/deepspeed_zero3.yaml",
                    port: int = DEFAULT_PORT) -> dict:
    """The command line for each launcher (multi-node ones are run on every node, with NODE_RANK set there)."""
    world = nodes * gpus_per_node
    job = ["launch/train.py", "--config", config_path, *overrides]
    cmds: dict = {}
    if world == 1:
        cmds["python"] = _join(["python", *job])
    if nodes == 1:
        cmds["torchrun"] = _join(["torchrun", "--standalone", f"--nproc_per_node={gpus_per_node}", *job])
        cmds["deepspeed"] = _join(["deepspeed", f"--num_gpus={gpus_per_node}", f"--master_port={port}", *job])
        cmds["accelerate"] = _join(["accelerate", "launch", "--config_file", accelerate_config,
                                    f"--num_processes={world}", f"--main_process_port={port}", *job])
    else:
        cmds["torchrun"] = _join(["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={gpus_per_node}",
                                  "--node_rank=$NODE_RANK", "--master_addr=$MASTER_ADDR", f"--master_port={port}", *job])
        cmds["deepspeed"] = _join(["deepspeed", "--hostfile=hostfile", f"--num_nodes={nodes}",
                                   f"--num_gpus={gpus_per_node}", "--master_addr=$MASTER_ADDR", f"--master_port={port}",
                                   *job])
        cmds["accelerate"] = _join(["accelerate", "launch", "--config_file", accelerate_config,
                                    f"--num_processes={world}", f"--num_machines={nodes}", "--machine_rank=$NODE_RANK",
                                    "--main_process_ip=$MASTER_ADDR", f"--main_process_port={port}",
                                    "--deepspeed_multinode_launcher=standard", *job])
    env = ["CONFIG=" + shlex.quote(config_path)]
    sb = ["sbatch", f"--nodes={nodes}", f"--ntasks-per-node={gpus_per_node}", f"--gpus-per-node={gpus_per_node}"]
    cmds["slurm"] = " ".join(env) + " " + _join([*sb, "slurm/train.sbatch", *overrides])
    cmds["slurm+deepspeed"] = " ".join(env) + " " + _join(
        ["sbatch", f"--nodes={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={gpus_per_node}",
         "slurm/train_deepspeed.sbatch", *overrides])
    return cmds


def _fmt(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 10 else f"{b / 2**20:.2f} MiB"


def _check_topology(world_size, nodes, gpus_per_node) -> int:
    for name, v in (("world_size", world_size), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if gpus_per_node is None:
        if world_size % nodes:
            raise ValueError(f"world_size={world_size} is not divisible by nodes={nodes}; pass gpus_per_node")
        return world_size // nodes
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node: expected an int >= 1, got {gpus_per_node!r}")
    if nodes * gpus_per_node != world_size:
        raise ValueError(f"world_size={world_size} must equal nodes * gpus_per_node = {nodes} * {gpus_per_node} "
                         f"= {nodes * gpus_per_node}")
    return gpus_per_node


def plan(cfg: Config, world_size: int, nodes: int = 1, gpus_per_node: Optional[int] = None, *,
         config_path: str = "configs/default.yaml", overrides: Sequence[str] = (),
         memory_gib: Optional[float] = None) -> str:
    """The plan as text; a config that cannot run at this world size fails here with its ConfigError."""
    gpus_per_node = _check_topology(world_size, nodes, gpus_per_node)
    derived = check_config(cfg, world_size)
    sizes = {"actor": model_size(cfg, "actor"), "critic": model_size(cfg, "critic")}
    mem = estimate_memory(cfg, derived, nodes, gpus_per_node, sizes)
    r, a = cfg.rollout, cfg.actor
    seq = sequence_tokens(cfg)
    unit = "rank" if cfg.trainer.device == "cpu" else "GPU"
    sp = cfg.model.sequence_parallel_size
    sp_note = f" / model.sequence_parallel_size {sp}" if sp > 1 else ""
    act, crit = sizes["actor"], sizes["critic"]
    lines = [f"verl_ds plan: {nodes} node(s) x {gpus_per_node} rank(s) per node = world size {world_size}", "",
             "== models (parameter counts from the config; no weights read) ==",
             f"actor, ref: {act.total:,} parameters (largest layer {act.largest_layer:,}, vocab {act.vocab_size:,}) "
             f"from {act.source}",
             f"critic:     {crit.total:,} parameters (backbone + value head) from {crit.source}", "",
             f"== memory per {unit}: model states, before activations ({cfg.model.dtype}) ==",
             f"{'':<18}{'ZeRO':>4}  {'offload':<13}{'per ' + unit:>12}{'CPU per node':>15}"]
    for role in ("actor", "critic", "ref"):
        m = mem[role]
        off = ",".join(k for k, on in (("optim", m.offload_optimizer), ("param", m.offload_param)) if on) or "none"
        lines.append(f"{role:<18}{m.zero_stage:>4}  {off:<13}{_fmt(m.gpu_bytes):>12}{_fmt(m.cpu_bytes_per_node):>15}")
    if r.engine == "vllm":
        kv = (f"rollout.vllm_kv_cache_bytes{'' if r.vllm_kv_cache_bytes else ', the CPU default'}, reserved at start"
              if mem.get("vllm_fraction") is None else
              f"not counted: with the weights, vLLM takes {mem['vllm_fraction']} of the GPU")
        lines += [f"{'vLLM weights':<18}{'':>4}  {'':<13}{_fmt(mem['rollout_replica']):>12}"
                  f"   (rollout.engine=vllm: its own copy, rollout.vllm_dtype={r.vllm_dtype})",
                  f"{'vLLM KV cache':<18}{'':>4}  {'':<13}{_fmt(mem['kv_cache']):>12}   ({kv})"]
    else:
        if mem["rollout_replica"]:
            lines.append(f"{'rollout replica':<18}{'':>4}  {'':<13}{_fmt(mem['rollout_replica']):>12}"
                         "   (rollout.gather_params=true: a whole actor copy for generate)")
        lines.append(f"{'KV cache':<18}{'':>4}  {'':<13}{_fmt(mem['kv_cache']):>12}   (generate: "
                     f"{derived.prompts_per_rank} prompt(s) per {unit} x {seq} tokens x {act.num_layers} layers x "
                     f"K,V of {act.kv_dim})")
    build = ("each trained model is built whole (ZeRO stage < 3), the reference partitioned"
             if mem["actor"].zero_stage < 3 else
             "every model is created partitioned (ZeRO-3), one layer gathered at a time")
    lines += [f"{'total':<18}{'':>4}  {'':<13}{_fmt(mem['steady']):>12}{_fmt(mem['cpu_per_node']):>15}",
              f"plus: fp32 logits of one micro-batch ({a.micro_batch_size} x {seq} tokens x {act.vocab_size:,}"
              f"{sp_note}) {_fmt(mem['logits'])} per {unit}, and activations",
              f"activations of one actor micro-batch: {mem['activation_tokens']:,} tokens per {unit}{sp_note}, "
              f"{act.num_layers} layers x hidden {act.hidden_size}"
              f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}: about "
              f"{_fmt(mem['activations'])} per {unit} (34 x hidden bytes per token and layer at 16 bits, "
              f"arXiv:2205.05198)",
              *fit_advice(cfg, mem, device_memory(cfg, memory_gib), unit),
              f"start-up: {build}: {_fmt(mem['startup_peak'])} per {unit} above the states, "
              f"{_fmt(mem['cpu_build_peak'])} CPU per node, transient",
              "sources: " + "; ".join(f"{role}: {mem[role].note}" for role in ("actor", "critic", "ref")),
              "DeepSpeed's estimators assume 16-bit weights with fp32 master copies; an fp32 job needs about "
              "as much (4+4+8 bytes per trained parameter)", "",
              "== batch arithmetic ==",
              f"rollout.batch_size {r.batch_size} prompts per step = {derived.prompts_per_rank} per rank x "
              f"{world_size} rank(s); up to {r.batch_size * seq:,} tokens per step ({seq} = " + (
                  "agent.max_context_tokens)" if cfg.agent.environment is not None else
                  f"max_prompt_length {cfg.data.max_prompt_length} + max_new_tokens {r.max_new_tokens})"),
              f"actor.mini_batch_size {a.mini_batch_size} = micro_batch_size {a.micro_batch_size} x grad_accum "
              f"{derived.grad_accum} x {world_size} rank(s) (DeepSpeed train_batch_size)",
              f"optimizer steps per PPO step: actor {a.ppo_epochs} epoch(s) x {derived.mini_batches_per_epoch} "
              f"mini-batch(es) = {a.ppo_epochs * derived.mini_batches_per_epoch}, critic {cfg.critic.ppo_epochs} x "
              f"{derived.mini_batches_per_epoch} = {cfg.critic.ppo_epochs * derived.mini_batches_per_epoch}",
              f"trainer.total_steps {cfg.trainer.total_steps}: {cfg.trainer.total_steps * r.batch_size:,} prompts", "",
              "== launch (from the repository root) =="]
    if nodes > 1:
        lines.append(f"multi-node: run torchrun/accelerate on every node with NODE_RANK=0..{nodes - 1} and MASTER_ADDR="
                     f"<node 0>; deepspeed once, with a hostfile of '<host> slots={gpus_per_node}' lines")
    acc = "configs/accelerate/deepspeed_zero3_cpu.yaml" if cfg.trainer.device == "cpu" else \
        "configs/accelerate/deepspeed_zero3.yaml"
    for name, cmd in launch_commands(nodes, gpus_per_node, config_path, overrides, acc).items():
        lines.append(f"{name + ':':<17}{cmd}")
    return "\n".join(lines) + "\n"
