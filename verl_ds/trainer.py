"""The PPO trainer: one readable loop over DeepSpeed engines, scheduled through the Models module.

Each step (``train_step``), every phase under a named timer whose name is its metric key:

  boundary   rank 0 applies staged SharedState updates, bumps global_step; ``sync()`` to all ranks
  gen        this rank's shard of the prompt batch -> responses (HF generate)
  old_log_prob / ref / values   actor, reference and critic forward passes (no grad)
  reward     through the ModelRegistry, so a hot-swapped reward takes effect at once
  adv        KL in the reward (default), GAE, DP-global advantage whitening
  update_critic / update_actor  PPO epochs x mini-batches x micro-batches, token-mean exact over
             ranks and gradient accumulation
  kl_ctrl    the KL controller sees the global KL and writes kl_coef to SharedState
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import defaultdict
from typing import Optional

import numpy as np
import torch

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds import reliability
from verl_ds.config import Config, initial_state, validate
from verl_ds.engines.build import (build_actor_model, build_critic_model, load_tokenizer, make_engine, set_lr)
from verl_ds.metrics import MetricsLogger, Timings, mean_of_lists, reduce_across_ranks
from verl_ds.report import summarize
from verl_ds.rollout import Rollout

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def global_masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening with mean and (Bessel-corrected) variance over every data-parallel rank's tokens."""
    m = mask.to(torch.float64)
    xd = torch.where(mask, x.to(torch.float64), torch.zeros((), dtype=torch.float64))
    stats = vdist.all_reduce_sum(torch.stack([m.sum(), xd.sum(), (xd * xd).sum()]))
    n, s, ss = stats.tolist()
    if n < 2:
        raise ValueError(f"cannot whiten advantages over {int(n)} valid token(s) across all ranks; need at least 2")
    mean = s / n
    var = (ss - n * mean * mean) / (n - 1)
    out = (x.to(torch.float64) - mean) / np.sqrt(max(var, 0.0) + eps)
    return out.to(torch.float32)


class PPOTrainer:
    """Builds everything from a ``Config`` and runs ``fit()``; see the module docstring for one step."""

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo):
        self.cfg = cfg
        self.launch = launch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.trainer.device == "auto" else cfg.trainer.device
        self.derived = validate(cfg, launch.world_size)  # fails before any model is built
        reliability.preflight(cfg)  # paths, tokenizer files, reward functions, run directory
        self.preemption = reliability.PreemptionHandler().install()  # SIGTERM/SIGUSR1: checkpoint, exit 75
        vdist.init_distributed(launch, cfg.trainer.dist_timeout_s, self.device)
        self.rank, self.world = vdist.rank(), vdist.world_size()
        self.is_main = self.rank == 0
        seed_everything(cfg.trainer.seed * 1000 + self.rank)
        self.out_dir = cfg.trainer.output_dir
        self.ckpt_root = os.path.join(self.out_dir, "checkpoints")
        if self.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "config.yaml"), "w", encoding="utf-8") as fh:
                fh.write(cfg.to_yaml())
        vdist.barrier()
        self.metrics = MetricsLogger(self.out_dir, enabled=self.is_main, tensorboard=cfg.trainer.tensorboard,
                                     wandb=cfg.trainer.wandb, config=cfg.to_dict())
        self.server = None
        self.fault_hook = reliability.FaultInjector.from_env(self.rank)  # VERL_DS_FAULT: tests break real runs
        self.guard = reliability.NonFiniteGuard(cfg.trainer.max_bad_steps, self.out_dir, self.rank, self.world)
        self._swap_lock = threading.Lock()
        self._pending_swap = None
        self._build()

    # ------------------------------------------------------------------ construction

    def _build(self) -> None:
        from verl_ds.models import PolicyModel, PPOConfig, PPOModel, ValueModel
        from verl_ds.registry import ModelRegistry
        from verl_ds.state import SharedState

        cfg = self.cfg
        self.tokenizer = tok = load_tokenizer(cfg)
        self.train_set, self.val_set = self._build_data()
        from verl_ds.data import DistributedPromptSampler

        self.sampler = DistributedPromptSampler(len(self.train_set), self.derived.prompts_per_rank, self.rank,
                                                self.world, seed=cfg.trainer.seed)
        actor_model = build_actor_model(cfg, tok)
        if cfg.actor.sft_warmup_steps:
            self._sft_warmup(actor_model)
        ref_model = build_actor_model(cfg, tok)
        ref_model.load_state_dict(actor_model.state_dict())  # the reference is the (warmed-up) initial policy
        critic_model = build_critic_model(cfg, tok, actor_model=actor_model)
        dz = self.derived
        self.actor = make_engine(actor_model, cfg, dz, "actor", lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay,
                                 grad_clip=cfg.actor.grad_clip)
        self.critic = make_engine(critic_model, cfg, dz, "critic", lr=cfg.critic.lr,
                                  weight_decay=cfg.critic.weight_decay, grad_clip=cfg.critic.grad_clip)
        self.ref = make_engine(ref_model, cfg, dz, "ref")
        self.rollout = Rollout(self.actor, tok, gather_params=cfg.rollout.gather_params)
        if self.fault_hook is not None:
            self.fault_hook.attach(self.actor.module)

        self.state = SharedState(rank=self.rank)
        if self.is_main:
            self.state.update(initial_state(cfg))
        self.state.sync()

        self.registry = ModelRegistry()
        policy, ref_policy, value = PolicyModel(self.actor), PolicyModel(self.ref), ValueModel(self.critic)
        reward = self.build_reward(cfg.reward.functions, cfg.reward.model_path, cfg.reward.model_weight)
        if self.is_main:
            self.state.set("reward_name", "+".join(str(f if isinstance(f, str) else f["name"]) for f in cfg.reward.functions)
                           + (" +model" if cfg.reward.model_path else ""))
        self.registry.register("actor", policy, aliases=("ppo_actor", "policy"))
        self.registry.register("critic", value, aliases=("value", "ppo_critic"))
        self.registry.register("ref", ref_policy, aliases=("reference",))
        self.registry.register("reward", reward, aliases=("reward_model",))
        self.ppo_config = PPOConfig(loss_agg_mode=cfg.algo.loss_agg_mode, clip_ratio_c=cfg.algo.clip_ratio_c,
                                    kl_in_reward=cfg.algo.kl_placement == "reward",
                                    whiten_advantages=cfg.algo.whiten_advantages, kl_horizon=cfg.algo.kl_horizon)
        # PPOModel looks its components up in our registry at every call: a swapped reward is used at once
        self.ppo = PPOModel(actor=policy, critic=value, reward=reward, ref=ref_policy, state=self.state,
                            config=self.ppo_config, registry=self.registry)
        self.registry.register("ppo", self.ppo)
        if self.is_main and cfg.server.enabled:
            self._start_server()

    def _start_server(self) -> None:
        """The /v1 control plane on rank 0 (a daemon thread; it never blocks the training loop)."""
        from verl_ds.server import ControlServer

        sc = self.cfg.server
        self.server = ControlServer(self.state, self.registry, host=sc.host, port=sc.port, token=sc.token,
                                    max_body_bytes=sc.max_body_bytes, run_dir=self.out_dir,
                                    metrics_fn=self.metrics.snapshot, reward_swapper=self)
        url = self.server.start()
        print(f"verl_ds: control server at {url} (GET {url}/v1/models)", flush=True)

    def _build_data(self):
        from verl_ds.data import PromptDataset
        from verl_ds.tasks import parity

        cfg, tok = self.cfg, self.tokenizer
        common = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                      overlong=cfg.data.overlong, apply_chat_template=cfg.data.apply_chat_template,
                      passthrough_keys=list(cfg.data.passthrough_keys) or None)
        if cfg.data.train_files is None:
            train = PromptDataset.from_records(parity.generate_prompts(cfg.data.num_train_prompts, seed=cfg.trainer.seed),
                                               tok, **common)
            val = PromptDataset.from_records(parity.generate_prompts(cfg.data.num_val_prompts, seed=10_000 + cfg.trainer.seed),
                                             tok, **common)
        else:
            train = PromptDataset.from_file(cfg.data.train_files, tok, **common)
            val = PromptDataset.from_file(cfg.data.val_files, tok, **common) if cfg.data.val_files else None
        if self.is_main:
            for name, ds in (("train", train), ("val", val)):
                if ds is not None and sum(ds.report().values()):
                    log.warning("%s prompts: %s", name, ds.summary())
            reliability.write_data_report(self.out_dir, {"train": train, "val": val})
        return train, val

    def build_reward(self, functions: list, model_path: Optional[str], model_weight: Optional[float]):
        """A RewardModel from reward function specs (shipped names or 'module:fn') and an optional neural scorer."""
        from verl_ds.models import RewardModel
        from verl_ds.rewards import resolve_reward_fn

        rc = self.cfg.reward
        scorer = None
        if model_path is not None:
            from transformers import AutoModelForSequenceClassification

            from verl_ds.config import ConfigError

            if not os.path.isdir(model_path):
                raise ConfigError(f"reward model path {model_path!r} does not exist or is not a directory")
            rm = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
            scorer = make_engine(rm, self.cfg, self.derived, "ref")
        reward = RewardModel(model=scorer, tokenizer=self.tokenizer, eos_reward=rc.eos_reward,
                             model_weight=rc.model_weight if model_weight is None else model_weight)
        for spec in functions:
            spec = {"name": spec} if isinstance(spec, str) else dict(spec)
            name = spec["name"]
            reward.register_reward_fn(resolve_reward_fn(name), name=name.split(":")[-1],
                                      weight=float(spec.get("weight", 1.0)), per_token=bool(spec.get("per_token", False)))
        return reward

    # ------------------------------------------------------------------ reward hot swap

    def stage_reward_swap(self, spec: dict, client: str = "") -> dict:
        """Validate a reward swap request (``rewards.parse_reward_swap``) and queue it for the next step
        boundary (rank 0, any thread); the control server calls this for ``POST /v1/models/reward``."""
        from verl_ds.rewards import parse_reward_swap

        request = {**parse_reward_swap(spec), "client": client}
        with self.state.lock, self._swap_lock:  # same lock order as the step boundary
            self._pending_swap = request
            applies_at = self.state.get("global_step") + 1
        return {"staged": {k: v for k, v in request.items() if k != "client"}, "applies_at_step": applies_at}

    def _apply_reward_swap(self, request: dict) -> None:
        """At a step boundary: every rank builds the staged reward and registers it (collective)."""
        reward = self.build_reward(functions=request["functions"], model_path=request["model_path"],
                                   model_weight=request["model_weight"])
        self.ppo.swap("reward", reward)  # registers it under "reward" (aliases kept), bumps its version
        if self.is_main:
            name = "+".join(f["name"] for f in request["functions"]) + (" +model" if request["model_path"] else "")
            old = (self.state.get("reward_version"), self.state.get("reward_name"))
            self.state.update({"reward_version": old[0] + 1, "reward_name": name})
            self._audit([{"key": "reward", "old": old[1], "new": name, "client": request["client"],
                          "spec": {k: v for k, v in request.items() if k != "client"}}], self.state.get("global_step"))

    def _sft_warmup(self, model) -> None:
        """Supervised warm start on the built-in task's reference responses (same on every rank: deterministic)."""
        from verl_ds.tasks import parity

        cfg, tok = self.cfg, self.tokenizer
        if cfg.data.train_files is not None:
            raise ValueError("actor.sft_warmup_steps needs the built-in task (data.train_files is set)")
        pairs = parity.sft_examples(cfg.actor.sft_warmup_steps * 16, seed=cfg.trainer.seed + 7)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.actor.lr)
        model.train()
        with torch.random.fork_rng(devices=[]):
            for i in range(cfg.actor.sft_warmup_steps):
                chunk = pairs[i * 16:(i + 1) * 16]
                texts = [p + " " + r for p, r in chunk]
                enc = tok(texts, return_tensors="pt", padding=True)
                labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
                loss = model(**enc, labels=labels).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()

    # ------------------------------------------------------------------ one PPO step

    def _forward_in_micro_batches(self, fn, batch) -> torch.Tensor:
        mb = self.cfg.rollout.log_prob_micro_batch_size
        return torch.cat([fn(batch.select(torch.arange(i, min(i + mb, len(batch))))) for i in range(0, len(batch), mb)])

    def _normalizer(self, mini) -> float:
        """The global count (tokens or sequences) of this mini-batch divided by dp_size * grad_accum.

        DeepSpeed divides each micro-batch loss by the accumulation count and averages gradients over
        ranks; dividing each micro-batch sum by this value makes the result an exact global mean.
        """
        mask = mini.response_mask
        if self.cfg.algo.loss_agg_mode == "token-mean":
            count = mask.sum()
        else:
            count = mask.any(dim=1).sum()
        total = vdist.all_reduce_sum(count.to(torch.float64)).item()
        return max(total, 1.0) / (self.world * self.derived.grad_accum)

    def _update(self, engine, batch, loss_fn, epochs: int, role: str) -> dict:
        cfg, step = self.cfg, self.state.get("global_step")
        per_rank, micro = self.derived.mini_batch_per_rank, cfg.actor.micro_batch_size
        metrics = defaultdict(list)
        for epoch in range(epochs):
            # the same order on every run of this step (resume-exact), different per step/epoch/role
            gen = torch.Generator().manual_seed(((cfg.trainer.seed * 1_000_003 + step) * 101 + epoch) * 2 + (role == "actor"))
            for mini in batch.split(per_rank, generator=gen, shuffle=True):
                norm = self._normalizer(mini)
                for mic in mini.split(micro, shuffle=False):
                    loss, m = loss_fn(mic, self.ppo_config, normalizer=norm)
                    # engine.backward + engine.step; the update is skipped on every rank when non-finite
                    self.guard.backward_and_step(engine, loss, role)
                    for k, v in m.items():
                        metrics[k].append(float(v))
                grad_norm = engine.get_global_grad_norm()
                if grad_norm is not None:
                    metrics[f"{role}/grad_norm"].append(float(grad_norm))
        out = mean_of_lists(metrics)
        out[f"{role}/lr"] = engine.optimizer.param_groups[0]["lr"]
        return out

    def train_step(self) -> dict:
        """One PPO step on every rank; returns the step's metrics (already reduced across ranks)."""
        from verl_ds.batch import RolloutBatch
        from verl_ds.data import collate_prompts

        cfg, st, tok = self.cfg, self.state, self.tokenizer
        t = Timings()
        start = time.perf_counter()
        with t("boundary"):
            swap = None
            if self.is_main:
                # one atomic boundary: an update or swap staged concurrently lands wholly before or after it,
                # so the step announced to its client is the step it is applied at
                with st.lock:
                    changes = st.apply_staged()
                    with self._swap_lock:
                        swap, self._pending_swap = self._pending_swap, None
                    st.set("global_step", st.get("global_step") + 1)
                self._audit(changes, st.get("global_step"))
            swap = vdist.broadcast_object(swap)
            if swap is not None:
                self._apply_reward_swap(swap)
            st.sync()
        step = st.get("global_step")
        self.guard.begin_step()
        if self.fault_hook is not None:
            self.fault_hook.step_begin(step)
        set_lr(self.actor, st.get("actor_lr"))
        set_lr(self.critic, st.get("critic_lr"))

        items = [self.train_set[i] for i in self.sampler.next_batch()]
        prompts = self._to_device(collate_prompts(items, tok.pad_token_id))
        with t("gen"):
            if self.rollout.gather_params:
                self.rollout.sync_replica()
            gen = self.rollout.generate(prompts["input_ids"], prompts["attention_mask"],
                                        max_new_tokens=st.get("max_new_tokens"), temperature=st.get("temperature"),
                                        top_k=st.get("top_k"), top_p=st.get("top_p"))
        batch = RolloutBatch.from_generation(prompts["input_ids"], prompts["attention_mask"], gen.responses,
                                             gen.response_length, gen.done, pad_token_id=tok.pad_token_id,
                                             extras={"prompt": prompts["prompts"], **prompts["extras"]})
        temperature, kl_coef = st.get("temperature"), st.get("kl_coef")  # this step's values, identical on every rank
        with torch.no_grad():
            with t("old_log_prob"):
                actor = self.registry.get("actor")
                batch.logprob = self._forward_in_micro_batches(
                    lambda b: actor.get_logprob(b.observation, b.action, mask=b.mask, temperature=temperature), batch)
            with t("ref"):
                ref = self.registry.get("ref")
                batch.ref_logprob = self._forward_in_micro_batches(
                    lambda b: ref.get_logprob(b.observation, b.action, mask=b.mask, temperature=temperature), batch)
        with t("reward"):
            responses = tok.batch_decode([r[:n] for r, n in zip(batch.action.tolist(), batch.response_length.tolist())],
                                         skip_special_tokens=True)
            scores, reward_metrics = self.registry.get("reward").compute_rewards(batch, prompts["prompts"], responses)
            batch.score = scores
        with t("adv"):
            adv_metrics = self.ppo.compute_advantage(batch, self.ppo_config, whiten_fn=global_masked_whiten)
        critic_metrics = actor_metrics = kl_metrics = {}
        updates = self.derived.mini_batches_per_epoch * (cfg.critic.ppo_epochs + cfg.actor.ppo_epochs)
        if not self.guard.check_batch(batch, planned_updates=updates):  # non-finite on any rank: no update anywhere
            batch.validate(tok.pad_token_id)
            with t("update_critic"):
                critic_metrics = self._update(self.critic, batch, self.ppo.compute_value_loss, cfg.critic.ppo_epochs, "critic")
            with t("update_actor"):
                actor_metrics = self._update(self.actor, batch, self.ppo.compute_policy_loss, cfg.actor.ppo_epochs, "actor")
            with t("kl_ctrl"):
                kl_metrics = self._update_kl_controller(batch)

        n_tokens = float(batch.mask.sum())
        metrics = {**reward_metrics, **adv_metrics, **critic_metrics, **actor_metrics, **kl_metrics,
                   "response_length/mean": float(batch.response_length.float().mean()),
                   "response_length/clip_ratio": float((~batch.done).float().mean()),
                   "prompt_length/mean": float(batch.prompt_length.float().mean()),
                   # what this rank used: averaged over ranks, a rank that missed an update would show
                   "actor/kl_coef": kl_coef, "state/temperature": temperature,
                   "state/version": float(st.version), "state/reward_version": float(st.get("reward_version"))}
        metrics = reduce_across_ranks(metrics)
        step_time = time.perf_counter() - start
        total_tokens = reduce_across_ranks({"n": n_tokens}, op="sum")["n"]
        metrics.update(reduce_across_ranks(t.as_metrics(), op="mean"))
        metrics.update({"timing_s/step": step_time, "perf/total_num_tokens": total_tokens,
                        "perf/throughput": total_tokens / step_time / self.world, "training/global_step": step})
        metrics.update(self.guard.end_step(step, batch, responses))
        return metrics

    def _to_device(self, prompts: dict) -> dict:
        """Prompt tensors onto the engines' device (a GPU under CUDA launchers)."""
        device = self.actor.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}

    def _update_kl_controller(self, batch) -> dict:
        """Feed the global mean KL (over every rank's response tokens) to the controller on rank 0."""
        from verl_ds.algos import kl_penalty

        kl = kl_penalty(batch.logprob, batch.ref_logprob, self.state.get("kl_kind"))
        mask = batch.response_mask
        s, n = vdist.all_reduce_sum(torch.stack([(kl * mask).sum().double(), mask.sum().double()])).tolist()
        current = s / max(n, 1.0)
        if self.is_main and np.isfinite(current):  # a NaN KL would poison kl_coef for good
            self.ppo.update(batch, self.ppo_config, observed_kl=current, n_samples=self.cfg.rollout.batch_size)
        return {"kl_ctrl/observed": current, "kl_ctrl/target": self.state.get("target_kl")}

    def _audit(self, changes: list, step: int) -> None:
        """Append applied changes to state_changes.jsonl (time, step, key, old, new, client)."""
        if not changes:
            return
        with open(os.path.join(self.out_dir, "state_changes.jsonl"), "a", encoding="utf-8") as fh:
            for change in changes:
                fh.write(json.dumps({"time": time.time(), "step": step, **change}, default=str) + "\n")

    # ------------------------------------------------------------------ validation, checkpoints, export

    @torch.no_grad()
    def validate(self) -> dict:
        """Greedy responses on the held-out prompts; the mean reward over every rank's shard."""
        from verl_ds.batch import RolloutBatch
        from verl_ds.data import collate_prompts

        if self.val_set is None:
            return {}
        tok = self.tokenizer
        n = (len(self.val_set) // self.world) * self.world
        idx = list(range(self.rank, n, self.world))
        if self.rollout.gather_params:
            self.rollout.sync_replica()
        total, count = 0.0, 0
        bs = self.derived.prompts_per_rank
        for i in range(0, len(idx), bs):
            prompts = self._to_device(collate_prompts([self.val_set[j] for j in idx[i:i + bs]], tok.pad_token_id))
            gen = self.rollout.generate(prompts["input_ids"], prompts["attention_mask"], greedy=True,
                                        max_new_tokens=self.state.get("max_new_tokens"))
            batch = RolloutBatch.from_generation(prompts["input_ids"], prompts["attention_mask"], gen.responses,
                                                 gen.response_length, gen.done, pad_token_id=tok.pad_token_id,
                                                 extras={"prompt": prompts["prompts"], **prompts["extras"]})
            responses = tok.batch_decode([r[:k] for r, k in zip(gen.responses.tolist(), gen.response_length.tolist())],
                                         skip_special_tokens=True)
            scores, _ = self.registry.get("reward").compute_rewards(batch, prompts["prompts"], responses)
            total += float(scores.sum())
            count += len(responses)
        s = reduce_across_ranks({"s": total, "n": float(count)}, op="sum")
        return {"val/score/mean": s["s"] / max(s["n"], 1.0)}

    def trainer_state(self) -> dict:
        return {"shared_state": self.state.state_dict(), "kl_controller": self.ppo.kl_controller.state_dict(),
                "sampler": self.sampler.state_dict(), "global_step": self.state.get("global_step"),
                "reliability": self.guard.state_dict(),
                "registry_versions": {name: self.registry.version(name) for name in self.registry.names()}}

    def save_checkpoint(self) -> str:
        step = self.state.get("global_step")
        return ckpt.save(self.ckpt_root, step, self.actor, self.critic, self.trainer_state(),
                         keep_last=self.cfg.trainer.keep_last, fault_hook=self.fault_hook)

    def maybe_resume(self) -> int:
        """Resume per ``trainer.resume``; returns the step resumed from (0 for a fresh start)."""
        mode = self.cfg.trainer.resume
        if mode == "none":
            return 0
        step_dir = ckpt.find_resumable(self.ckpt_root) if mode == "auto" else mode
        step_dir = vdist.broadcast_object(step_dir)
        if step_dir is None:
            return 0
        state = ckpt.load(step_dir, self.actor, self.critic)
        self.state.load_state_dict(state["shared_state"])
        self.ppo.kl_controller.load_state_dict(state["kl_controller"])
        self.sampler.load_state_dict(state["sampler"])
        self.guard.load_state_dict(state.get("reliability", {}))
        self.metrics.truncate_after(state["global_step"])
        if self.is_main:
            log.info("resumed from %s (step %d)", step_dir, state["global_step"])
        return int(state["global_step"])

    def export_hf(self, directory: Optional[str] = None) -> str:
        """The trained actor in HF format (safetensors), loadable by AutoModelForCausalLM, plus the tokenizer."""
        from verl_ds.rollout import empty_like, gathered_state_dict

        directory = directory or os.path.join(self.out_dir, "hf_actor")
        state = gathered_state_dict(self.actor.module)  # a collective: every rank takes part
        if self.is_main:
            model = empty_like(self.actor.module)
            model.load_state_dict(state)
            model.save_pretrained(directory, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
        vdist.barrier()
        return directory

    # ------------------------------------------------------------------ the loop

    @reliability.explains_rank_failures  # a dead or silent rank: RankFailure saying so, not a bare gloo error
    def fit(self) -> dict:
        """Run until ``trainer.total_steps``; returns a summary (reward before/after, time, tokens/s)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        start_step = self.maybe_resume()
        t0 = time.perf_counter()
        tokens = 0.0
        val_every = cfg.trainer.val_every
        if start_step == 0:
            self.metrics.log(0, self.validate())
        bar = tqdm(total=cfg.trainer.total_steps, initial=start_step, disable=not (self.is_main and cfg.trainer.progress_bar),
                   desc="ppo", dynamic_ncols=True)
        last_saved = start_step or None  # a resumed run that has nothing left to do re-saves nothing
        while self.state.get("global_step") < cfg.trainer.total_steps:
            signal_name = self.preemption.stop_requested()  # collective: every rank stops at the same step
            if signal_name:
                self._stop_preempted(signal_name, last_saved)
            metrics = self.train_step()
            step = int(metrics["training/global_step"])
            tokens += metrics["perf/total_num_tokens"]
            if val_every and step % val_every == 0 and step < cfg.trainer.total_steps:
                metrics.update(self.validate())
            if step == cfg.trainer.total_steps:
                metrics.update(self.validate())
            self.metrics.log(step, metrics)
            self.guard.raise_if_exhausted()  # NonFiniteError after trainer.max_bad_steps bad steps in a row
            bar.update(1)
            bar.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                            kl=f"{metrics.get('kl_ctrl/observed', 0.0):.3f}")
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
                self.save_checkpoint()
                last_saved = step
        bar.close()
        final = self.state.get("global_step")
        if last_saved != final:
            self.save_checkpoint()
        export_dir = self.export_hf() if cfg.trainer.export_hf else None
        elapsed = time.perf_counter() - t0
        summary = summarize(self.metrics.history(), self.state.get("global_step"), elapsed, tokens, self.out_dir,
                            export_dir, plot=self.cfg.trainer.plot, write=self.is_main)
        self.close()
        return summary

    def _stop_preempted(self, signal_name: str, last_saved) -> None:
        """Checkpoint the finished steps, then exit with PREEMPTED_EXIT_CODE (the sbatch script requeues)."""
        step = self.state.get("global_step")
        if step > 0 and last_saved != step:
            self.save_checkpoint()
        saved = os.path.join(self.ckpt_root, f"global_step_{step}") if step > 0 else None
        self.close()
        exc = reliability.Preempted(signal_name, step, saved)
        if self.is_main or self.preemption.received:
            print(f"[rank{self.rank}] {exc.message}", flush=True)
        vdist.barrier()
        raise exc

    def close(self) -> None:
        """Stop the control server and flush loggers (also safe after a failure)."""
        self.preemption.uninstall()
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.metrics.close()
