"""Construction: the config in, one plain object with every component of a run out (``build``). Only what the
algorithm needs is built: a critic when the advantage estimator needs one, a reference when a KL term can be non-zero
(a LoRA actor's is its own engine with adapters off); models are registered under their roles and aliases."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from verl_ds import algos
from verl_ds.config import Config, ConfigError, Derived, sequence_tokens
from verl_ds.config.limits import has_reference  # the same rule limits the hot KL keys
from verl_ds.engines.build import build_engines, build_reward_engine, load_tokenizer
from verl_ds.engines.teacher import build_teacher_engine

log = logging.getLogger(__name__)

ROLE_ALIASES = {"actor": ("ppo_actor", "policy"), "critic": ("value", "ppo_critic"), "ref": ("reference",),
                "reward": ("reward_model",)}


@dataclass
class Components:
    """Everything a run is made of; the trainer schedules it."""
    tokenizer: Any
    train_set: Any
    val_set: Any
    sampler: Any
    engines: dict  # role -> DeepSpeed engine: "actor", and "critic" / "ref" when built
    state: Any  # SharedState
    registry: Any  # ModelRegistry: actor, reward, critic?, ref?, ppo
    ppo: Any  # PPOModel
    extra: dict = field(default_factory=dict)
    sequence_parallel: Any = None  # this rank's SequenceParallel group (model.sequence_parallel_size > 1)


def build(cfg: Config, derived: Derived, rank: int, world: int, out_dir: str,
          data: Optional["PromptData"] = None) -> Components:
    """Tokenizer, data (``data``: already loaded by ``load_data``), engines, SharedState, models and registry, on
    every rank (collective)."""
    from verl_ds.sampler import DistributedPromptSampler
    from verl_ds.weights.lora import lora_spec
    from verl_ds.models import PolicyModel, PPOModel, ReferenceModel, ValueModel
    from verl_ds.models.policy import AdaptersOffReferenceModel
    from verl_ds.registry import ModelRegistry
    from verl_ds.rollout_engines import build_rollout_engine, check_rollout_engine
    from verl_ds.state import SharedState

    check_rollout_engine(cfg)  # e.g. rollout.engine=vllm without vLLM: refused before any model is built
    data = load_data(cfg) if data is None else data
    if rank == 0:
        report_data(data, out_dir)
    tok, train_set, val_set = data.tokenizer, data.train, data.val
    sampler = DistributedPromptSampler(len(train_set), derived.prompts_per_rank, rank, world, seed=cfg.trainer.seed)

    actor_lora = lora_spec(cfg, "actor")
    if actor_lora is None and cfg.trainer.export == "adapter":
        raise ConfigError("trainer.export=adapter needs actor.lora_rank > 0 (a fully fine-tuned actor has no "
                          "adapters); use trainer.export=merged")
    roles = ["actor"]
    if has_reference(cfg) and actor_lora is None:  # a LoRA actor is its own reference, adapters off
        roles.append("ref")
    if algos.get_advantage_estimator(cfg.algo.adv_estimator).needs_critic:
        roles.append("critic")
    # every model is created already partitioned under ZeRO-3; the reference is the (warmed-up) initial policy
    engines = build_engines(cfg, derived, tok, roles=roles, sft_warmup=warmup_of(cfg, tok))
    teacher = build_teacher_engine(cfg, derived, tok)  # None: no distillation, or the LoRA actor's own base
    scorers = {**engines, **({} if teacher is None else {"teacher": teacher})}  # one row layout for them all

    state = SharedState.from_config(cfg, rank=rank)  # the run's limits and step-0 values, the same on every rank
    packed, shared = packing_decision(cfg.model, scorers, say=rank == 0, longest=sequence_tokens(cfg),
                                      share=cfg.model.share_prompts and cfg.rollout.n > 1)  # one copy per prompt
    fused = cfg.model.fused_lm_head
    prefixes = shared and cfg.model.share_response_prefixes  # and of its samples' common response prefixes
    from verl_ds.models.sequence_parallel import setup_sequence_parallel

    sp = setup_sequence_parallel(cfg.model.sequence_parallel_size, scorers, packed)  # packed rows split over ranks

    # rollout.engine from the registry in verl_ds.rollout_engines (hf: a LoRA actor's replica has its adapters merged)
    # with split placement the generation ranks sample; the training ranks' engine only serves validation: hf
    rollout_engine = build_rollout_engine(cfg, engines["actor"], tok, state=state, rank=rank, lora=actor_lora,
                                          engine="hf" if cfg.rollout.split_ranks else None)
    scoring = dict(state=state, remove_padding=packed, fused_lm_head=fused, share_prompts=shared,
                   share_prefixes=prefixes, sequence_parallel=sp)  # the actor's and the reference's row layout
    models = {"actor": PolicyModel(engines["actor"], rollout_engine=rollout_engine, tokenizer=tok, **scoring),
              "reward": build_reward(cfg, tok, derived, state=state)}
    if "critic" in engines:
        models["critic"] = ValueModel(engines["critic"], state=state, remove_padding=packed, sequence_parallel=sp)
    if "ref" in engines:
        models["ref"] = ReferenceModel(engines["ref"], **scoring)
    elif actor_lora is not None and has_reference(cfg):  # the actor's engine, scoring with its adapters off
        models["ref"] = AdaptersOffReferenceModel(engines["actor"], **scoring)
    registry = ModelRegistry()
    for role, model in models.items():
        registry.register(role, model, aliases=ROLE_ALIASES[role])
    ppo = PPOModel(state=state, algo=cfg.algo, registry=registry,
                   is_cap=cfg.rollout.is_cap if cfg.rollout.is_correction else None, is_mode=cfg.rollout.is_mode,
                   is_low=cfg.rollout.is_low, is_rejection=cfg.rollout.is_rejection,
                   **models)
    registry.register("ppo", ppo)
    if teacher is not None:  # scores the actor's samples (on-policy distillation)
        registry.register("teacher", ReferenceModel(teacher, **scoring))
    elif cfg.distill.teacher_path is not None:  # "base": the LoRA actor, adapters off (the reference when built)
        registry.register("teacher", models.get("ref") or AdaptersOffReferenceModel(engines["actor"], **scoring))
    if rank == 0:
        state.set("reward_name", reward_name(cfg.reward.functions, cfg.reward.model_path))
    return Components(tokenizer=tok, train_set=train_set, val_set=val_set, sampler=sampler, engines=engines,
                      state=state, registry=registry, ppo=ppo, sequence_parallel=sp)


def warmup_of(cfg: Config, tok) -> Optional[Callable]:
    """``actor.sft_warmup_steps`` steps of the SFT loss on the built-in task's demonstrations, or None."""
    from verl_ds.sft_loss import WARMUP_BATCH, warm_up
    from verl_ds.tasks import builtin_task

    steps, task = cfg.actor.sft_warmup_steps, builtin_task(cfg)
    if steps and task is None:
        raise ConfigError("actor.sft_warmup_steps needs the built-in task (data.train_files is set)")
    seed = cfg.trainer.seed + 7  # demonstrations apart from the prompt rows
    return None if not steps else lambda engine: warm_up(
        engine, task.demonstrations(tok, steps * WARMUP_BATCH, seed), tok.pad_token_id, lr=task.warmup_lr)


def packing_decision(model, engines: dict, say: bool, longest: int, share: bool = False,
                     remove_padding: Optional[bool] = None) -> tuple[bool, bool]:
    """(packed, shared): packed rows and (with ``share``) shared prompts, probed on the models built
    (``packing_support``; ``model``: the config's model section); a family they would get wrong falls back to padded
    batches or plain packing, with one log line."""
    import torch

    from verl_ds.attention_layout import resolve_attn_implementation
    from verl_ds.hf_module import device_of
    from verl_ds.models.families import packing_support

    device_type = torch.device(device_of(next(iter(engines.values())))).type
    implementation = resolve_attn_implementation(model.attn_implementation, device_type)
    if not (model.remove_padding if remove_padding is None else remove_padding):
        _padded_attention(engines, implementation, say)
        return False, False
    want_shared = share
    support = {role: packing_support(e, longest, share=want_shared and role != "critic", implementation=implementation)
               for role, e in engines.items()}
    refused = [(role, s.packing) for role, s in support.items() if s.packing is not None]
    if refused:
        if say:
            log.warning("model.remove_padding: the %s cannot be packed (%s); padded batches are used", *refused[0])
        _padded_attention(engines, implementation, say)
        return False, False
    refused = [(role, s.sharing) for role, s in support.items() if s.sharing is not None and role != "critic"]
    shared = want_shared and not refused
    if want_shared and refused:
        if say:
            log.warning("model.share_prompts: the %s cannot share prompts (%s); packed rows without shared prompts "
                        "are used", *refused[0])
        for role, e in engines.items():  # back to the plain-packing kernel everywhere
            support[role] = packing_support(e, longest, share=False, implementation=implementation)
    notes = sorted({s.note for s in support.values() if s.note})
    if say and notes:
        log.warning("model.attn_implementation: %s", "; ".join(notes))
    return True, shared


def _padded_attention(engines: dict, implementation: str, say: bool) -> None:
    """Padded batches on ``implementation``; a family with its own attention code (e.g. Bloom's ALiBi) keeps it: it
    reads the padding mask itself, so padded batches stay exact on it."""
    from verl_ds.models.varlen_attention import use_attention

    for role, e in engines.items():
        try:
            use_attention(e, implementation)
        except ValueError as exc:
            if say:
                log.warning("model.attn_implementation=%s: the %s keeps its own attention on padded batches (%s)",
                            implementation, role, exc)


class PromptData(NamedTuple):
    """The tokenizer and the prompt sets of a run (``load_data``)."""
    tokenizer: Any
    train: Any
    val: Any
    unscorable: dict  # data set name -> why one of its rows could not be scored (for the log line)


def load_data(cfg: Config) -> PromptData:
    """The tokenizer and the checked (train, val) prompt sets (ConfigError naming the key), before torch.distributed."""
    from verl_ds.data import PromptDataset
    from verl_ds.rewards import unscorable_rows
    from verl_ds.tasks import builtin_task
    from verl_ds.verifiable import set_math_verify_timeout

    set_math_verify_timeout(cfg.reward.math_verify_timeout_s)  # the start-up check below parses the references
    tok = load_tokenizer(cfg)
    common = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                  overlong=cfg.data.overlong, apply_chat_template=cfg.data.apply_chat_template,
                  passthrough_keys=list(cfg.data.passthrough_keys) or None)
    task = builtin_task(cfg)
    if task is not None:
        train = PromptDataset.from_records(task.rows(cfg.data.num_train_prompts, cfg.trainer.seed), tok, **common)
        val = PromptDataset.from_records(task.rows(cfg.data.num_val_prompts, 10_000 + cfg.trainer.seed), tok, **common)
    else:
        train = _from_file("data.train_files", cfg.data.train_files, tok, common)
        val = _from_file("data.val_files", cfg.data.val_files, tok, common) if cfg.data.val_files else None
    unscorable = {}
    for name, ds in (("train", train), ("val", val)):  # rows the reward functions cannot score: skipped, counted
        bad = unscorable_rows(ds, cfg.reward.functions) if ds is not None else {}
        if bad:
            ds.drop(bad, "unscorable")
            unscorable[name] = next(iter(bad.values()))
        if ds is not None and len(ds) == 0:
            raise ConfigError(f"{ds.source}: no row can be scored by reward.functions; {ds.summary()}")
    if len(train) < cfg.rollout.batch_size:
        where = "data.train_files" if cfg.data.train_files is not None else "data.num_train_prompts"
        raise ConfigError(f"rollout.batch_size={cfg.rollout.batch_size} is larger than the {len(train)} usable "
                          f"prompts of {where} ({train.summary()}): a step draws rollout.batch_size distinct prompts; "
                          "lower rollout.batch_size or add prompts")
    return PromptData(tok, train, val, unscorable)


def _from_file(key: str, path: str, tok, options: dict):
    from verl_ds.data import PromptDataset

    try:
        return PromptDataset.from_file(path, tok, **options)
    except ValueError as exc:  # the file as a whole is unusable (unreadable, no usable prompt): the user's input
        raise ConfigError(f"{key}: {exc}") from None


def report_data(data: PromptData, out_dir: str) -> None:
    """Log what was skipped or counted in each prompt set and write ``<out_dir>/data_report.json`` (rank 0)."""
    from verl_ds.data import write_data_report

    for name, ds in (("train", data.train), ("val", data.val)):
        if ds is None:
            continue
        if name in data.unscorable:
            log.warning("%s: %d row(s) the reward functions cannot score are skipped, e.g. %s", ds.source,
                        ds.report()["unscorable"], data.unscorable[name])
        if sum(ds.report().values()):
            log.warning("%s prompts: %s", name, ds.summary())
    write_data_report(out_dir, {"train": data.train, "val": data.val})


def reward_name(functions: list, model_path: Optional[str]) -> str:
    return "+".join(str(f if isinstance(f, str) else f["name"]) for f in functions) + (" +model" if model_path else "")


def build_reward(cfg: Config, tok, derived: Derived, functions: Optional[list] = None, model_path: Optional[str] = None,
                 model_weight: Optional[float] = None, state=None):
    """A RewardModel from function specs (shipped names or 'module:fn') and an optional neural scorer (building it is
    a collective); defaults: the config's ``reward`` section."""
    from verl_ds.models import RewardModel
    from verl_ds.rewards import resolve_reward_fn
    from verl_ds.tasks import builtin_task
    from verl_ds.verifiable import set_math_verify_timeout

    rc = cfg.reward
    set_math_verify_timeout(rc.math_verify_timeout_s)
    if functions is None:
        functions, model_path, model_weight = rc.functions, rc.model_path, rc.model_weight
    scorer = build_reward_engine(cfg, derived, model_path) if model_path is not None else None
    reward = RewardModel(model=scorer, tokenizer=tok, state=state, eos_reward=rc.eos_reward,
                         model_weight=rc.model_weight if model_weight is None else model_weight,
                         micro_batch_size=cfg.rollout.log_prob_micro_batch_size, num_workers=rc.num_workers)
    for spec in functions:
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = spec["name"]
        reward.register_reward_fn(resolve_reward_fn(name), name=name.split(":")[-1],
                                  weight=float(spec.get("weight", 1.0)), per_token=bool(spec.get("per_token", False)))
    if not functions and model_path is None and cfg.distill.teacher_path is not None \
            and cfg.agent.environment is None:  # distillation alone trains
        # the built-in task's rule is still logged (e.g. reward/parity/mean), at weight 0; other data score nothing
        task = builtin_task(cfg)
        rule = None if task is None else task.rule
        reward.register_reward_fn(resolve_reward_fn(rule) if rule else _unscored, name=rule or "none", weight=0.0)
    return reward


def _unscored(prompts: list, responses: list, batch=None) -> list:
    return [0.0] * len(responses)
