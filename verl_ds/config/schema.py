"""The job configuration: a tree of dataclasses, one field per key, each with its type, default, range and help.

A field with ``hot="<name>"`` is also the SharedState key ``<name>`` (``verl_ds.state`` derives its schema from
these fields: same default, range, choices and help), so it can be changed over HTTP while the run trains.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Iterator, Literal, Optional

import yaml

from .fields import Spec, _f, spec_of

REDACTED = "<redacted>"
TOKEN_ENV = "VERL_DS_SERVER_TOKEN"
# logits / temperature must stay finite in fp32 and bf16 (both top out at 3.4e38): at 1e-38 a logit of 4
# already overflows to inf and the softmax gives NaN, and 5e-324 is 0 in fp32 (a division by zero). At 1e-2
# logits are scaled by 100, far from overflow, and sampling is already close to greedy.
MIN_TEMPERATURE = 1e-2
# numpy's legacy global seed is 32 bits (np.random.seed); torch and the sampler take any int >= 0 below it too
MAX_SEED = 2**32 - 1
# the built-in task's prompts are generated and tokenized on every rank before training (about 20 us each):
# 2^20 take about 20 s; more would stall the start for minutes and hold gigabytes of small Python objects
MAX_GENERATED_PROMPTS = 1 << 20
# torch.distributed converts the timeout to a timedelta and then to int64 milliseconds; 30 days is far beyond
# any wait a job means (a hung rank must be noticed)
MAX_DIST_TIMEOUT_S = 30 * 86400
# Scores are float32 (largest 3.4e38). With every reward weight and penalty at most 1e6 in magnitude, a weighted
# score and its square (the critic's squared error) stay finite there for raw scores up to 1e12.
MAX_REWARD_WEIGHT = 1e6

_DS_DEFAULT = "DeepSpeed's own default applies ({}); to change it set zero_optimization.{} in a deepspeed.config_file"
# removed key -> what to do instead: a config that still sets one is refused naming it (exit 2), never ignored
REMOVED_KEYS = {
    **{f"deepspeed.{k}": _DS_DEFAULT.format(v, k) for k, v in (
        ("stage3_max_live_parameters", "1e9"), ("stage3_max_reuse_distance", "1e9"),
        ("stage3_prefetch_bucket_size", "5e7"), ("stage3_param_persistence_threshold", "1e5"))},
    "model.pad_is_eos": "save a tokenizer whose pad token is its EOS token and point model.tokenizer_path at it",
    "reward.micro_batch_size": "the reward model's forwards use rollout.log_prob_micro_batch_size, as every no-grad "
                               "forward does",
    "trainer.verify_checkpoint": "a resume checks the digests the checkpoint was saved with: whole files when "
                                 "trainer.checkpoint_digest=full, else each file's first and last MiB",
    "server.max_body_bytes": "request bodies are capped at 64 KiB, far above what a route takes (a state update or a "
                             "reward swap: a few hundred bytes)",
    # CPU-only speed switches
    "model.cpu_linear": "oneDNN Linear layers for AMD CPUs left the package (no GPU counterpart); delete the key: "
                        "float32 CPU Linears use F.linear",
    "deepspeed.grad_accumulation_fusion": "a ZeRO-0 CPU optimisation that left the package; delete the key: weight "
                                          "gradients accumulate through autograd",
    "trainer.cpu_keep_freed_memory": "glibc malloc tuning for CPU runs left the package; delete the key, or set "
                                     "MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ in the environment (mallopt(3))",
}


LOGGERS = ("progress_bar", "plot", "tensorboard", "wandb")
OFFLOADS = ("optimizer", "param")


@dataclass
class ModelConfig:
    path: Optional[str] = _f(None, "Local HF causal LM directory for the actor (and ref/critic backbone). None: build a tiny model from `arch` and `config_overrides`.", nonempty=True)
    critic_path: Optional[str] = _f(None, "Local HF directory for the critic backbone; None: same as `path` (or the tiny config).", nonempty=True)
    tokenizer_path: Optional[str] = _f(None, "Local tokenizer directory; None: the model path's tokenizer, or the built-in word-level tokenizer.", nonempty=True)
    arch: Literal["llama", "qwen2"] = _f("llama", "Architecture of the model built from config when `path` is None.")
    config_overrides: dict = _f({}, "HF config fields set on the model config (verl's override_config), e.g. {num_hidden_layers: 4, hidden_size: 128} or model.config_overrides.hidden_size=128 on the command line. The model built from config (`path` None) starts from Llama/Qwen2 fields hidden_size 64, intermediate_size 128, num_hidden_layers 2, num_attention_heads 4, num_key_value_heads 2, max_position_embeddings 256; a model from `path` (and ref, and the critic unless `critic_path` is set) gets them on its config.json (shape fields must match the checkpoint). A field the family's config does not have is refused; vocab_size and the special token ids come from the tokenizer.")
    dtype: Literal["fp32", "bf16"] = _f("fp32", "Parameter / compute dtype of actor, critic and reference engines.")
    gradient_checkpointing: bool = _f(False, "Activation checkpointing in actor and critic (HF gradient_checkpointing_enable).")
    remove_padding: bool = _f(True, "Pack each micro-batch's real tokens into one row (position ids restart per sequence, attention never crosses sequences) for log-prob, value and update forwards, each response's last token read as a label only (its output would predict nothing); models whose attention cannot do it fall back to padded batches, with a log line.")
    share_prompts: bool = _f(True, "With remove_padding and rollout.n > 1: the samples of one prompt in a micro-batch share one copy of its tokens in the packed row (their responses attend to it), so log-prob and update forwards skip (n-1)/n of the prompt tokens; the same log-probs and gradients.")
    share_response_prefixes: bool = _f(True, "With share_prompts: the samples of one prompt also share the leading response tokens they have in common (a token's state depends on its prefix only), so those are computed once in log-prob and update forwards; the same log-probs and gradients. Saves most where samples agree on their first tokens (short answers, a policy that has converged).")
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"] = _f("auto", "Attention kernel of actor, critic and reference: auto (flash_attention_2 on CUDA with flash-attn installed, else flex_attention on CUDA, else sdpa) or a transformers name. Packed rows: flash-attention serves plain packing, flex_attention every layout (shared prompts and prefixes too), sdpa/eager every layout one sequence or prompt group at a time; a layout a kernel cannot serve goes to one that can, with a log line. One not usable on this device is refused at start-up.")
    fused_lm_head: bool = _f(False, "Log-probs and entropy from the final hidden states and the LM-head weight in chunks (online log-sum-exp), never building the (N, V) logits.")
    sequence_parallel_size: int = _f(1, "DeepSpeed-Ulysses degree of actor, critic and reference: groups of this many consecutive ranks score and train each packed micro-batch together, each rank holding 1/degree of the row's tokens (attention all-to-all over heads), so activation memory per rank falls by about the degree; each rank's micro-batches go in turn, the same log-probs, values and update as degree 1. Must divide the world size and the attention and key/value heads; needs remove_padding. Generation stays data-parallel.", min=1, max=1 << 10)
    init_seed: int = _f(1234, "Seed for the weights of models built from config (identical on every rank).", min=0, max=MAX_SEED)


@dataclass
class DataConfig:
    train_files: Optional[str] = _f(None, "Prompt file (.jsonl, .ndjson, .json, .parquet, or a datasets save_to_disk dir). None: the built-in parity task, generated.", nonempty=True)
    val_files: Optional[str] = _f(None, "Held-out prompt file for validation; None with the built-in task: a generated held-out set.", nonempty=True)
    prompt_key: str = _f("prompt", "Field holding the prompt text.", nonempty=True)
    passthrough_keys: list = _f([], "Extra fields passed to reward functions in batch.extras (e.g. ['answer']).", items=str, nonempty=True)
    max_prompt_length: int = _f(32, "Prompt token limit.", min=1)
    overlong: Literal["truncate", "skip"] = _f("truncate", "What to do with prompts longer than max_prompt_length (counted either way).")
    apply_chat_template: bool = _f(False, "Wrap each prompt as a user message with the tokenizer's chat template.")
    num_train_prompts: int = _f(4096, "Built-in task only: number of generated training prompts (generating and tokenizing them costs about 20 us each on every rank).", min=1, max=MAX_GENERATED_PROMPTS)
    num_val_prompts: int = _f(64, "Built-in task only: number of generated held-out prompts.", min=1, max=MAX_GENERATED_PROMPTS)


@dataclass
class RolloutConfig:
    batch_size: int = _f(32, "Prompts per PPO step, summed over data-parallel ranks.", min=1)
    n: int = _f(1, "Responses sampled per prompt (a group, kept on one rank): each step has batch_size * n samples.", min=1)
    max_new_tokens: int = _f(8, "Response token limit; also at most the model's context minus data.max_prompt_length.", min=1, max=1 << 20, hot="max_new_tokens")
    temperature: float = _f(1.0, f"Sampling temperature, also used to score log-probs; >= {MIN_TEMPERATURE} so logits / temperature stays finite in fp32/bf16.", min=MIN_TEMPERATURE, max=100.0, hot="temperature")
    top_k: int = _f(0, "Top-k sampling (0 disables).", min=0, hot="top_k")
    top_p: float = _f(1.0, "Nucleus sampling (1.0 disables).", gt=0.0, max=1.0, hot="top_p")
    log_prob_micro_batch_size: int = _f(64, "Samples per rank in one no-grad forward (old/ref log-probs, values, reward-model scores, validation).", min=1)
    log_prob_max_tokens_per_micro_batch: Optional[int] = _f(None, "Token budget of one no-grad forward (old/ref log-probs; shared prompts count once, as in actor.max_tokens_per_micro_batch); null: log_prob_micro_batch_size samples. Micro-batches are formed by total tokens, the same count on every rank.", min=1)
    gather_params: bool = _f(True, "Gather the actor's ZeRO-3 parameters once per generate call into a replica (fast); False: per-token gathering under synced_gpus.")
    share: Literal["decode", "prefill", "none"] = _f("decode", "HF engine: what the n samples of a prompt share while generating (the same tokens either way). prefill: one prefill per prompt (the prompt runs once, its key/value cache is copied to each sample and each sample's first token is drawn from its last logits, so generate takes one step fewer; not under gather_params=false on several ranks). decode: that, and each decoding step runs one row per distinct (prompt, tokens so far) among the unfinished samples instead of one per sample (samples that drew the same tokens share a cache row until they differ; finished samples run nothing). none: plain generate.")
    engine: Literal["hf", "vllm"] = _f("hf", "Rollout engine: hf (HF generate on the actor, see gather_params) or vllm (a colocated in-process vLLM engine per rank, weights synced from the actor after every update; install with scripts/install_vllm.sh, see docs/vllm.md).")
    vllm_dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "vLLM's weight and compute dtype; auto: model.dtype. A dtype other than the trainer's makes the rollout slightly off-policy (see is_correction).")
    vllm_gpu_memory_utilization: float = _f(0.5, "vLLM on a GPU: the fraction of the GPU's memory vLLM may take for its weights and KV cache (it reserves it up front; leave room for the DeepSpeed engines). Unused on CPU, where vllm_kv_cache_bytes sizes the cache.", gt=0.0, max=1.0)
    vllm_kv_cache_bytes: Optional[int] = _f(None, "vLLM's KV cache in bytes; null: 256 MiB on CPU, the room vllm_gpu_memory_utilization leaves on a GPU.", min=1 << 20)
    vllm_enforce_eager: Optional[bool] = _f(None, "vLLM without torch.compile and CUDA graphs; null: true on CPU (compiling costs about a minute there), false on a GPU.")
    vllm_sleep: bool = _f(False, "GPU only: put vLLM to sleep after each generate call (KV cache freed, weights offloaded to CPU memory) and wake it for the next generate or weight sync, so the update phases get its GPU memory.")
    is_correction: bool = _f(False, "Rollout-mismatch correction: weight each token's policy-gradient loss by the importance ratio pi_trainer / pi_sampler = exp(old_log_probs - rollout_log_probs) as is_mode says, for a sampler whose log-probs differ from the trainer's (vLLM, a bf16 rollout, an asynchronous sampler's older weights); metrics actor/is_* and actor/mismatch_* (docs/vllm.md).")
    is_cap: float = _f(2.0, "Upper bound C of the importance ratio (is_correction): truncate modes weight min(ratio, C), mask modes leave out (weight 0) what lies above C.", min=1.0, max=1e6)
    is_mode: Literal["truncate", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geo_mask", "decoupled"] = _f("truncate", "With is_correction, the ratio per token, per sequence (exp of the summed token log-ratios) or the sequence's geometric mean (exp of their mean), truncated or masked: token_truncate (truncate is its first name; TIS, Yao et al. 2025), token_mask (IcePop with is_low > 0), sequence_truncate, sequence_mask (TRL's modes), geo_mask (weight 1 where the geometric mean lies in [is_low, is_cap], else 0), or decoupled (AReaL's decoupled PPO, Fu et al. 2025, arXiv:2505.24298: token_mask around the actor before the update; use it with mode one_step_off or streaming, docs/async.md).")
    is_low: float = _f(0.0, "Lower bound of the band [is_low, is_cap] of the mask modes (token_mask, sequence_mask, geo_mask, decoupled); 0: one-sided, as TRL's masks; e.g. 0.5 with is_cap 2 masks two-sided (IcePop).", min=0.0, lt=1.0)
    is_rejection: Optional[str] = _f(None, "verl's rejection criteria, with or without is_correction: 'criterion:threshold[,...]' leaves out (weight 0) each token, or each whole sequence, whose divergence statistic exceeds its threshold; criteria token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (k1: a band 'low_high' of pi_sampler / pi_trainer, or one number u for [1/u, u]; seq_mean_k1 is the geometric-mean sequence mask). E.g. 'token_k3:0.01' or 'seq_mean_k1:0.999_1.001'.", nonempty=True)
    mode: Literal["sync", "one_step_off", "streaming"] = _f("sync", "sync: generate, then train, every step (lock-step). one_step_off: batch k+1 generates (on a replica, in a thread) while batch k trains, with the weights before that update. streaming: generation runs ahead up to max_staleness versions, weights swap in mid-response (each token keeps its version); see docs/async.md.")
    max_staleness: int = _f(1, "mode=streaming: no sample whose oldest token is more than this many actor updates old is trained on (0: the synchronous run, bit for bit); stale_samples says what happens to older ones.", min=0, max=64, hot="max_staleness")
    split_ranks: int = _f(0, "Split placement: the last split_ranks ranks only generate (a whole actor copy each, weights broadcast from the trainers after every update), the others train; 0: every rank does both (colocated). Needs mode=one_step_off or streaming; see docs/async.md.", min=0)
    stale_samples: Literal["drop", "regenerate"] = _f("regenerate", "mode=streaming: a group past max_staleness is dropped (counted; dropping biases towards short responses, the long ones go stale), or its prompt is generated again with the current weights.")


@dataclass
class ActorConfig:
    lr: float = _f(1e-3, "Actor learning rate.", gt=0.0, max=1.0, hot="actor_lr")
    weight_decay: float = _f(0.0, "AdamW weight decay.", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "Gradient clipping by global norm (0 disables).", min=0.0)
    ppo_epochs: int = _f(1, "Passes over each rollout batch.", min=1)
    mini_batch_size: int = _f(32, "Samples per optimizer step, summed over ranks; divides rollout.batch_size * rollout.n.", min=1)
    micro_batch_size: int = _f(16, "Samples per forward/backward on one rank, actor and critic (gradient accumulation fills the mini-batch); must divide the per-rank mini-batch.", min=1)
    reuse_on_policy_log_probs: bool = _f(True, "When every actor update is on-policy (actor.ppo_epochs=1, one mini-batch per step), no KL term is in the reward, the update's forward is the log-prob pass's (no dropout acts: actor.lora_dropout > 0 keeps the pass) and rollout.engine=hf, skip the old-log-prob forward: the loss's old log-probs are its own, detached (the ratio is exactly 1), as TRL's GRPOTrainer does.")
    max_tokens_per_micro_batch: Optional[int] = _f(None, "Token budget of one actor forward/backward (prompt + response tokens; with model.share_prompts a prompt counts once and its samples stay in one micro-batch while they fit); null: micro_batch_size samples. Micro-batches are formed by total tokens and balanced, the same count on every rank; the loss stays the exact global token mean. The critic's value and update forwards use the same budget.", min=1)
    sft_warmup_steps: int = _f(0, "Supervised warm-up steps on the task's reference responses before PPO (built-in task only).", min=0)
    lora_rank: int = _f(0, "LoRA rank of the actor's adapters (peft, pip install 'verl_ds[lora]'); 0: full fine-tuning. With LoRA only the adapters train, and no reference model is built: the reference is the actor with its adapters off. Adapters learn more slowly per step: raise actor.lr (2e-3 on the built-in task, 5x full fine-tuning's; 5e-3 and 1e-2 learn faster, then collapse).", min=0)
    lora_alpha: float = _f(16.0, "LoRA alpha: the adapters' product B A is scaled by lora_alpha / lora_rank.", gt=0.0)
    lora_dropout: float = _f(0.0, "Dropout on the adapters' input, in the update's forwards only (sampling and log-prob passes stay deterministic).", min=0.0, lt=1.0)
    lora_target_modules: list = _f(["all-linear", "output-head"], "Modules given adapters: names or dotted suffixes (e.g. [q_proj, v_proj]), checked against the model; 'all-linear': every linear layer except the LM head; 'output-head': the LM head unless it is tied to the input embedding (a frozen head caps how sharp the policy can get when the base's logits are weak, as in the built-in task's random model).", items=str, nonempty=True)


@dataclass
class CriticConfig:
    lr: float = _f(5e-3, "Critic learning rate.", gt=0.0, max=1.0, hot="critic_lr")
    weight_decay: float = _f(0.0, "AdamW weight decay.", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "Gradient clipping by global norm (0 disables).", min=0.0)
    ppo_epochs: int = _f(1, "Critic passes over each rollout batch.", min=1)
    lora_rank: int = _f(0, "LoRA rank of adapters on the critic's backbone (peft); 0: the whole critic trains. Alpha, dropout and target modules are the actor's (actor.lora_*; output-head does not apply: the value head always trains whole).", min=0)
    cliprange_value: float = _f(0.5, "Value-loss clip range around the old values; 0 means no value clipping (the plain squared error).", min=0.0, max=1e6, hot="cliprange_value")


@dataclass
class AlgoConfig:
    adv_estimator: str = _f("gae", "Advantage estimator from the registry in verl_ds.algos (gae needs the critic; the others are critic-free).")
    gamma: float = _f(1.0, "Discount.", min=0.0, max=1.0, hot="gamma")
    lam: float = _f(0.95, "GAE lambda.", min=0.0, max=1.0, hot="lam")
    kl_placement: Literal["auto", "reward", "loss"] = _f("auto", "Where the KL penalty goes: subtracted from the token rewards, or added to the actor loss; auto = the estimator's convention: the loss for grpo, dr_grpo, reinforce_plus_plus and reinforce_plus_plus_baseline (their std normalisation or batch whitening would turn KL noise between equally rewarded samples into unit advantages), the reward for gae, rloo and remax.")
    use_kl_penalty: bool = _f(True, "Apply the KL penalty at all (it is off when kl_coef is 0 with the fixed controller).", hot="use_kl_penalty")
    kl_kind: str = _f("auto", "KL estimator: k1|kl, abs, k2|mse, k3|low_var_kl, symmetric (per token, from the sampled tokens' log-probs), or full_symmetric: the exact 0.5 (KL(pi||ref) + KL(ref||pi)) over the whole vocabulary at each response position, loss placement only (the reference's final hidden states are recomputed in the update; the KL controller sees the symmetric estimate); auto = k1 in the reward, low_var_kl in the loss (k1 in the loss has a zero-mean gradient and is refused).", config_only=("auto",), hot="kl_kind")
    kl_coef: float = _f(0.01, "KL coefficient beta (the KL controller rewrites it after each update).", min=0.0, max=1e3, hot="kl_coef")
    kl_ctrl: Literal["fixed", "band", "ziegler"] = _f("band", "KL controller: fixed; band (coef x1.5 when KL > 1.5 target, x0.8 when KL < 0.5 target); ziegler (Ziegler et al. 2019, proportional).", hot="kl_ctrl_type")
    target_kl: float = _f(0.1, "Target per-token KL (nats) of the band and ziegler controllers.", gt=0.0, max=1e3, hot="target_kl")
    kl_horizon: int = _f(10000, "Horizon of the ziegler controller.", min=1)
    clip_ratio_low: float = _f(0.2, "PPO ratio clip below 1 (epsilon_low; 1 - epsilon_low must stay > 0).", min=0.0, lt=1.0, hot="clip_ratio_low")
    clip_ratio_high: float = _f(0.2, "PPO ratio clip above 1 (epsilon_high).", min=0.0, max=10.0, hot="clip_ratio_high")
    clip_ratio_c: Optional[float] = _f(3.0, "Dual-clip constant for negative advantages (> 1; null disables); the vanilla policy loss only, the others ignore it (as verl).", gt=1.0)
    policy_loss: str = _f("vanilla", "Policy loss from the registry in verl_ds.algos (docs/algorithms.md): vanilla (PPO clip, dual clip); gspo (sequence-level ratio, token-level gradient; set clip_ratio_low/high to the paper's 3e-4/4e-4); geo_mean, alias gmpo (geometric mean of token ratios clipped in log space; paper: 0.4/0.4); cispo (stop-gradient clipped weight x advantage x log-prob; the paper has no lower bound: clip_ratio_low near 1); sapo (a sigmoid gate instead of the clip, sapo_tau_pos/neg; the clip ratios are ignored).")
    sapo_tau_pos: float = _f(1.0, "SAPO's gate temperature for positive advantages (verl's tau_pos; the paper's 1.0).", gt=0.0, max=1e3)
    sapo_tau_neg: float = _f(1.05, "SAPO's gate temperature for zero and negative advantages (verl's tau_neg; the paper's 1.05: a sharper gate for negative updates).", gt=0.0, max=1e3)
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.", min=0.0, max=1.0, hot="entropy_coef")
    loss_agg_mode: str = _f("auto", "How per-token losses are aggregated (exact across ranks and accumulation); auto = seq-mean-token-mean with policy_loss gspo, geo_mean or sapo (geo_mean and sapo take no other mode), else the estimator's convention: seq-mean-token-sum-norm for dr_grpo (Liu et al. 2025: each sequence's token sum over the constant rollout.max_new_tokens), token-mean for the others.", config_only=("auto",))
    whiten_advantages: bool = _f(True, "Whiten advantages with statistics global across data-parallel ranks.")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling (Yu et al. 2025): drop groups whose rewards (before the overlong penalty) are all equal and draw more prompts until the batch is full (paper: on).")
    max_sampling_rounds: int = _f(3, "Dynamic sampling: most rounds of prompts drawn per step; a rank still short then fills up with dropped groups.", min=1)
    overlong_buffer: int = _f(0, "DAPO soft overlong punishment: the last N tokens before rollout.max_new_tokens ramp the penalty from 0 to -overlong_penalty_factor (0: off; paper: 4096 of 20480).", min=0)
    overlong_penalty_factor: float = _f(1.0, "DAPO soft overlong punishment: the penalty at rollout.max_new_tokens (paper: 1.0).", min=0.0, max=MAX_REWARD_WEIGHT)


@dataclass
class AgentConfig:
    environment: Optional[str] = _f(None, "Multi-turn rollouts: the environment each trajectory runs in, a registered name (calc, guess_number) or 'package.module:Class' (docs/agents.md); null: one response per prompt. Each data set row is handed to the environment's reset; the environment's rewards are the score (reward.functions must be []).", nonempty=True)
    env_args: dict = _f({}, "Keyword arguments of the environment's constructor (e.g. {tool_format: hermes}).")
    max_turns: int = _f(4, "Model turns per trajectory at most (rollout.max_new_tokens tokens each).", min=1, max=1024)
    max_tool_calls: int = _f(8, "Tool calls per trajectory at most; one more ends it.", min=1, max=1 << 16)
    max_context_tokens: int = _f(256, "Tokens of a trajectory at most (its first prompt, model turns and environment answers); a turn starts only while rollout.max_new_tokens more fit.", min=2, max=1 << 20)
    step_timeout_s: float = _f(10.0, "Seconds an environment's reset or step may take; a slower one ends its trajectory (env_timeout).", gt=0.0, max=86400.0)
    allow_weak_sandbox: bool = _f(False, "Run model-written code (the python tool, the code_tests reward) even where bubblewrap cannot sandbox it; then only rlimits, Landlock where the kernel has it and an audit hook the code can remove stand between it and the trainer's files, processes and secrets. false: such a run is refused at start-up (docs/agents.md).")


@dataclass
class RewardConfig:
    functions: list = _f(["parity"], "Reward functions: shipped names (parity, exact_match, ...) or 'module:fn' / 'file.py:fn'; entries may be {name, weight, per_token} (|weight| <= 1e6; the shipped functions score whole sequences, per_token false).")
    model_path: Optional[str] = _f(None, "Local HF sequence-classification reward model (1 label), scored at the last real token.", nonempty=True)
    model_weight: float = _f(1.0, "Weight of the neural reward in the sum.", min=-MAX_REWARD_WEIGHT, max=MAX_REWARD_WEIGHT)
    num_workers: int = _f(1, "Threads scoring chunks of the batch with the reward functions (rule rewards can be slow; functions must be thread-safe).", min=1)
    math_verify_timeout_s: float = _f(5.0, "Seconds one math_verify check may take in its worker process; past it the worker is killed and the answer scores 0 (counted in reward/math_verify/timed_out).", gt=0.0, max=3600.0)
    eos_reward: Literal["zero", "keep"] = _f("zero", "Per-token rewards at the EOS position: zeroed or kept.")


@dataclass
class DistillConfig:
    teacher_path: Optional[str] = _f(None, "On-policy distillation (docs/stages.md): the teacher, a local HF causal-LM directory sharing the actor's tokenizer (its tokenizer files are compared at start-up), loaded frozen like the reference, that scores the actor's own samples each step; 'base': with actor.lora_rank > 0, the actor's base with its adapters off; null: off.", nonempty=True)
    coef: float = _f(1.0, "Weight of the per-token reverse KL to the teacher, -(log pi(y_t) - log pi_teacher(y_t)) on the sampled response tokens.", min=0.0, max=MAX_REWARD_WEIGHT)
    mode: Literal["advantage", "reward"] = _f("advantage", "Where the weighted term goes: advantage, added to the estimator's advantages (with reward.functions: [] it is the whole advantage: Agarwal et al. 2024, arXiv:2306.13649); reward, added to the task reward's token rewards before the advantage estimator.")


@dataclass
class SFTConfig:
    max_completion_length: int = _f(8, "The SFT job (verl-ds sft): a row's completion tokens at most (everything after the first trained token), and at most the model's context minus data.max_prompt_length; a longer completion is cut from the right, or the row skipped (data.overlong).", min=1, max=1 << 20)


@dataclass
class RMConfig:
    max_completion_length: int = _f(8, "The reward-model job (verl-ds rm): chosen and rejected completion tokens at most, and at most the model's context minus data.max_prompt_length; a pair with a longer one is skipped (cut, it is no longer what was ranked).", min=1, max=1 << 20)


@dataclass
class DPOConfig:
    beta: float = _f(0.1, "The DPO job (verl-ds dpo): beta, the strength of the implicit KL constraint to the reference (Rafailov et al. 2023); with loss ipo, IPO's regularisation tau (Azar et al. 2023).", gt=0.0, max=1e3)
    loss: Literal["sigmoid", "ipo"] = _f("sigmoid", "DPO loss: sigmoid, -log sigmoid(beta x) on the completions' summed log-prob ratios x; ipo, (x - 1/(2 beta))^2 on their per-token means (as TRL).")
    label_smoothing: float = _f(0.0, "Conservative DPO (Mitchell 2023): the probability that a pair's labels are flipped; the sigmoid loss only.", min=0.0, lt=0.5)
    reference_free: bool = _f(False, "No reference model: its log-probs are taken as 0 (a uniform reference), so no reference engine is built.")
    max_completion_length: int = _f(8, "Chosen and rejected completion tokens at most (as TRL's DPOConfig), and at most the model's context minus data.max_prompt_length; a pair with a longer one is skipped.", min=1, max=1 << 20)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = _f(3, "ZeRO stage of actor and critic (0-3); the reference (an inference engine) is ZeRO-3 when this is 3, else unpartitioned (as DeepSpeed-Chat).", min=0, max=3)
    offload: list = _f([], "What DeepSpeed offloads to CPU memory: optimizer (optimizer states), param (parameters, ZeRO-3 only); [] for nothing.", items=str, choices=OFFLOADS)
    config_file: Optional[str] = _f(None, "A DeepSpeed JSON object whose entries override the generated ones (batch sizes stay derived).", nonempty=True)

    @property
    def offload_optimizer(self) -> bool:
        return "optimizer" in self.offload

    @property
    def offload_param(self) -> bool:
        return "param" in self.offload


@dataclass
class TrainerConfig:
    total_steps: int = _f(150, "PPO steps to run.", min=1)
    output_dir: str = _f("runs/default", "Run directory: metrics, checkpoints, the HF export.", nonempty=True)
    resume: str = _f("auto", "auto (latest complete checkpoint in output_dir, if any) | none | a checkpoint directory (global_step_<N>).", nonempty=True)
    seed: int = _f(0, "Seed for data order, sampling and every rank's RNG.", min=0, max=MAX_SEED)
    save_every: int = _f(0, "Checkpoint every N steps (0: only at the end).", min=0)
    keep_last: int = _f(2, "Checkpoints kept (older ones are deleted).", min=1)
    checkpoint_digest: Literal["edges", "full"] = _f("edges", "Digests written with each checkpoint and checked when it is resumed: each file's first and last MiB (edges), or also whole files (full: finds a bit flip in the middle of a shard; about 11 s per GiB at save time, split over the ranks, and 5 s per GiB read at resume).")
    val_every: int = _f(0, "Greedy validation on the held-out prompts every N steps (0: start and end only).", min=0)
    val_n: int = _f(1, "Validation samples per prompt: >1 adds sampled val/mean@n, val/pass@1 and val/pass@n (unbiased, Chen et al. 2021) to the greedy score.", min=1)
    val_pass_threshold: float = _f(1.0, "A validation sample counts as correct for pass@k when its score is at least this.")
    export: Literal["merged", "adapter", "none"] = _f("merged", "HF export of the trained actor at the end (save_pretrained, safetensors): merged (with actor.lora_rank > 0 the adapters folded into the weights: a plain HF model for AutoModelForCausalLM), adapter (LoRA only: peft's adapter files, for PeftModel.from_pretrained on the base; a model built from config also gets its base in hf_actor/base) or none.")
    loggers: list = _f(["progress_bar", "plot"], "Where progress goes besides metrics.jsonl (always written): progress_bar (tqdm on rank 0), plot (reward_curve.png at the end, needs matplotlib), tensorboard, wandb (each if installed); [] for none.", items=str, choices=LOGGERS)
    dist_timeout_s: int = _f(300, "Collective timeout: a dead rank makes the others fail after this long.", min=1, max=MAX_DIST_TIMEOUT_S)
    max_bad_steps: int = _f(3, "Stop after this many consecutive steps with a non-finite loss or gradient.", min=1)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Device for the engines (auto: cuda when available; cuda without CUDA is refused).")


@dataclass
class ServerConfig:
    enabled: bool = _f(False, "Start the /v1 control-plane HTTP server on rank 0.")
    host: str = _f("127.0.0.1", "Bind address; a non-loopback address needs a token.", nonempty=True)
    port: int = _f(0, "Port (0: any free port; the URL is written to the run directory).", min=0, max=65535)
    token: Optional[str] = _f(None, f"Bearer token for mutating routes; prefer the {TOKEN_ENV} environment variable (never printed or saved).", secret=True)
    swappable_rewards: list = _f([], "Reward function specs ('module:fn', 'file.py:fn') that POST /v1/models/reward may swap in, besides the shipped names.", items=str, nonempty=True)
    allow_reward_code: bool = _f(False, "Let POST /v1/models/reward import any reward function code (logged loudly); off: shipped names and swappable_rewards only.")
    reward_model_dir: Optional[str] = _f(None, "Directory under which POST /v1/models/reward may load reward models; null: model paths are refused over HTTP.", nonempty=True)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self, redact: bool = True) -> dict:
        """The config as plain data; secrets (server.token) read ``"<redacted>"`` unless ``redact=False``
        (internal use only: never print, log or save that form)."""
        out = dataclasses.asdict(self)
        if redact:
            for dotted, _, spec, _ in iter_fields():
                section, name = dotted.split(".")
                if spec.secret and out[section][name] is not None:
                    out[section][name] = REDACTED
        return out

    def to_yaml(self, redact: bool = True) -> str:
        return yaml.safe_dump(self.to_dict(redact=redact), sort_keys=False)


def iter_fields(cls=Config) -> Iterator[tuple[str, object, Spec, dataclasses.Field]]:
    """``(dotted key, annotation, spec, field)`` for every leaf key, in declaration order."""
    hints = typing.get_type_hints(cls)
    for sec in fields(cls):
        sub = hints[sec.name]
        assert is_dataclass(sub), sec.name
        sub_hints = typing.get_type_hints(sub)
        for f in fields(sub):
            yield f"{sec.name}.{f.name}", sub_hints[f.name], spec_of(f), f


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def hot_fields() -> list[tuple[str, str, object, Spec]]:
    """``(state key, dotted config key, annotation, spec)`` of every hot-updatable field."""
    return [(spec.hot, dotted, tp, spec) for dotted, tp, spec, _ in iter_fields() if spec.hot]


def write_run_config(cfg: Config, path: str) -> str:
    """Write the redacted config as YAML to ``path``, readable by its owner only (mode 0600); returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(cfg.to_yaml())
    return path


def is_loopback(host: str) -> bool:
    """True when ``host`` only reaches this machine (127.0.0.0/8, ::1, or a name resolving only there);
    '', '0.0.0.0' and '::' mean every interface. Such a ``server.host`` needs no token (the gate and the server)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
