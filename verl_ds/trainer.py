"""The RL job: ``train_step`` under ``runtime.job.Job``'s loop, until ``trainer.total_steps``.
A step is these phases in order, each one call under the timer ``timing_s/<phase>``: boundary (hot changes), gen,
reward, old_log_prob, ref, teacher and values (only when needed), adv, update_critic, update_actor, weight_sync, kl_ctrl.
Construction is ``verl_ds.builder.build``; the numerics are ``verl_ds.algos``; checkpoints ``verl_ds.checkpoint``."""
from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.algos.distill import reverse_kl_term
from verl_ds.asyncrl.source import RolloutRun
from verl_ds.asyncrl.split import make_rollout_source
from verl_ds.batch import REQUIRED_FOR_LOSS
from verl_ds.builder import build, build_reward
from verl_ds.config import Config
from verl_ds.metrics import Timings, reduce_metrics, sample_means_over_ranks
from verl_ds.models.ppo import LOSS_SHARE_METRICS
from verl_ds.models.sequence_parallel import turns
from verl_ds.packing import micro_batch_groups
from verl_ds.report import summarize
from verl_ds.reward_trial import check_swap_rows, trial
from verl_ds.reward_spec import parse_reward_swap
from verl_ds.rollout import SamplingError, rollout_and_score, sampler_mismatch
from verl_ds.run.startup import check_startup
from verl_ds.runtime import StepFailed, raise_if_any_rank_failed
from verl_ds.runtime.job import Job
from verl_ds.step_boundary import ScoredByEnvironment, StepBoundary, start_control_server

log = logging.getLogger(__name__)


class Trainer(Job):
    """The RL job: built from a ``Config`` (``verl_ds.builder``); ``fit()`` is ``runtime.job.Job``'s."""

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo, data=None):
        # one gate: fails before torch.distributed starts or any model is built
        super().__init__(cfg, launch, check_startup(cfg, launch.world_size, launch.rank))
        self.progress_name = cfg.algo.adv_estimator
        self.c = build(cfg, self.derived, self.rank, self.world, self.out_dir, data=data)
        self.state, self.registry, self.ppo, self.tokenizer = self.c.state, self.c.registry, self.c.ppo, self.c.tokenizer
        spec = {"functions": list(cfg.reward.functions), "model_path": cfg.reward.model_path,
                "model_weight": cfg.reward.model_weight}
        data = (self.c.train_set, self.c.val_set)  # a swapped-in reward must score every row, as at start-up
        self.boundary = StepBoundary(self.state, self.out_dir, reward_spec=spec, install=self._install_reward,
                                     # the server checked the HTTP policy already
                                     check_swap=lambda s: check_swap_rows(parse_reward_swap(s), data, cfg.rollout.mode),
                                     build_reward=lambda s: build_reward(cfg, self.tokenizer, self.derived, s["functions"],
                                                                         s.get("model_path"), s.get("model_weight"),
                                                                         state=self.state),
                                     probe=lambda r: trial(r, self.tokenizer, data, self.actor_engine.device))
        self.rollout_fn = rollout_and_score  # one response per prompt, or multi-turn episodes
        if cfg.agent.environment is not None:
            from verl_ds.agent.rollout import AgentSpec, agent_rollout_fn

            self.rollout_fn = agent_rollout_fn(AgentSpec.from_config(cfg))
        # rollout.mode and placement: on the step (sync), a generation thread, or generation ranks
        self.run = RolloutRun.of(self)  # what the rollout source and the evaluation read of the run
        self.rollout_source = make_rollout_source(self.run)
        self.server = None  # started by fit() once the run's state is restored: a change is announced for its step

    @property
    def actor_engine(self):
        return self.c.engines["actor"]

    @property
    def engines(self) -> dict:
        return self.c.engines

    @property
    def global_step(self) -> int:
        return self.state.get("global_step")

    def _install_reward(self, reward) -> None:
        self.ppo.swap("reward", reward)  # registered under "reward" (aliases kept), version bumped

    # ------------------------------------------------------------------ one step

    def _planned_updates(self) -> int:
        """Optimizer steps a step makes: mini-batches x epochs, for the actor and (with one) the critic."""
        epochs = self.cfg.actor.ppo_epochs + self.cfg.critic.ppo_epochs * self.ppo.needs_critic
        return self.derived.mini_batches_per_epoch * epochs

    def train_step(self) -> dict:
        """One RL step on every rank; returns the step's metrics (reduced across ranks)."""
        cfg, tok = self.cfg, self.tokenizer
        t, start = Timings(), time.perf_counter()
        with t("boundary"):
            step = self.boundary.cross()
        self.guard.begin_step()
        self._emit("step_begin", step)
        hot = self.state.snapshot()
        rollout, error = None, None
        try:
            rollout = self.rollout_source.next_rollout(step, t)
        except SamplingError as exc:  # non-finite logits: skip the step everywhere, with a forensic record
            self.guard.sampling_error = str(exc)
        except Exception as exc:  # e.g. a reward function failing on one rank: every rank must stop together
            error = exc
        try:
            raise_if_any_rank_failed(error, f"step {step} failed before any update")
        except StepFailed:  # the fault's checkpoint is of the step before, and resumes with this step's prompts
            self._abandon(step)
            raise
        if vdist.any_rank(rollout is None):
            self.guard.skip_batch(None, planned_updates=self._planned_updates())  # the draw failed: no batch
            return {**self.guard.end_step(step, None), "training/global_step": step}
        batch = rollout.batch
        temperature = hot["temperature"]  # this step's value, identical on every rank
        with torch.no_grad():
            r = cfg.rollout
            log_prob_chunks = micro_batch_groups(batch, r.log_prob_micro_batch_size, r.log_prob_max_tokens_per_micro_batch,
                                                 share_prompts=self._shares_prompts("actor", "ref"))
            shortcut = self._on_policy_shortcut(hot)
            if not shortcut:  # else the loss uses its own log-probs, detached
                with t("old_log_prob"):
                    batch.old_log_probs = self._no_grad_pass("actor", batch, log_prob_chunks, lambda m, b: m.get_logprob(
                        b.observation, b.action, b.mask, temperature))
            if self.ppo.ref is not None:
                with t("ref"):
                    batch.ref_log_probs = self._no_grad_pass("ref", batch, log_prob_chunks, lambda m, b: m.get_logprob(
                        b.observation, b.action, b.mask, temperature))
            distill, distill_metrics = None, {}
            if "teacher" in self.registry:  # on-policy distillation: the teacher scores the actor's own samples
                with t("teacher"):  # a LoRA actor's base as the teacher is its reference: scored once
                    teacher = batch.ref_log_probs if self.registry.get("teacher") is self.ppo.ref else \
                        self._no_grad_pass("teacher", batch, log_prob_chunks, lambda m, b: m.get_logprob(
                            b.observation, b.action, b.mask, temperature))
                student = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
                term, distill_metrics = reverse_kl_term(student, teacher, batch.response_mask, cfg.distill.coef)
                distill = (cfg.distill.mode, term)
            if self.ppo.needs_critic:
                with t("values"):
                    chunks = micro_batch_groups(batch, cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch)
                    batch.values = self._no_grad_pass("critic", batch, chunks, lambda m, b: m.get_values(
                        b.observation, b.mask, b.response_width))
        baseline = batch.extras.get("baseline_score")
        with t("adv"):  # the reward metrics of the rows trained, over every rank's (also across a reward swap)
            metrics = {**rollout.metrics, **sample_means_over_ranks(rollout.per_sample), **self.ppo.compute_advantage(
                batch, whiten_fn=vdist.global_masked_whiten, distill=distill,
                baseline_scores=None if baseline is None else torch.tensor(baseline, device=batch.scores.device)),
                **distill_metrics}
        # a non-finite value on any rank skips the update on every rank
        if not self.guard.skip_batch(batch, planned_updates=self._planned_updates()):
            batch.validate(tok.pad_token_id, required=self._required_fields(old_log_probs=not shortcut))
            if self.ppo.needs_critic:
                with t("update_critic"):
                    metrics.update(self._update("critic", batch, self.ppo.compute_value_loss, cfg.critic.ppo_epochs,
                                                cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch)[0])
            with t("update_actor"):
                actor_metrics, actor_steps = self._update("actor", batch, self.ppo.compute_policy_loss,
                                                          cfg.actor.ppo_epochs, cfg.actor.micro_batch_size,
                                                          cfg.actor.max_tokens_per_micro_batch)
                metrics.update(actor_metrics)
            with t("weight_sync"):
                self.rollout_source.refresh()
            if self.is_main:  # which weights produced a rollout: the actor's optimizer steps so far
                self.state.set("actor_version", self.state.get("actor_version") + actor_steps)
            if self.ppo.ref is not None:
                with t("kl_ctrl"):
                    metrics.update(self._update_kl_controller(batch))
        rm = batch.response_mask
        metrics.update({
            **sampler_mismatch(batch),
            "response_length/mean": batch.response_length.float().mean(),
            "response_length/clip_ratio": (~batch.done).float().mean(),
            "prompt_length/mean": batch.prompt_length.float().mean(),
            "actor/kl_coef": hot["kl_coef"], "state/temperature": temperature,
            "state/version": float(self.state.version), "state/reward_version": float(hot["reward_version"])})
        metrics = reduce_metrics(metrics)  # the step's one host sync of the metrics
        step_time = time.perf_counter() - start
        total_tokens = reduce_metrics({"n": rm.sum()}, op="sum")["n"]
        metrics.update(reduce_metrics(t.as_metrics(), op="mean"))
        metrics.update({"timing_s/step": step_time, "perf/total_num_tokens": total_tokens,
                        "perf/throughput": total_tokens / step_time / self.world, "training/global_step": step})
        metrics.update(self.guard.end_step(step, batch, rollout.responses))
        return metrics

    def _abandon(self, step: int) -> None:
        """Undo a step that failed before any update (collective): its count, and its prompts go back."""
        self.boundary.uncross(step)
        self.rollout_source.rewind()

    def _on_policy_shortcut(self, hot: dict) -> bool:
        """Whether the old-log-prob forward can be skipped: one epoch and one mini-batch (on-policy), no KL in the
        reward, no dropout, and HF generate samples (vLLM's log-probs differ, and the KL controller reads the gap)."""
        a = self.cfg.actor
        return a.reuse_on_policy_log_probs and a.ppo_epochs == 1 and self.derived.mini_batches_per_epoch == 1 \
            and not self.ppo.kl_in_reward(hot) and self.cfg.rollout.engine == "hf" \
            and self.registry.get("actor").update_forward_is_scoring_pass

    def _required_fields(self, old_log_probs: bool) -> tuple:
        skipped = ({"old_log_probs"} if not old_log_probs else set()) | ({"values", "returns"} if not
                                                                          self.ppo.needs_critic else set())
        return tuple(f for f in REQUIRED_FOR_LOSS if f not in skipped)

    def _no_grad_pass(self, role: str, batch, groups: list, fn) -> torch.Tensor:
        """``fn(model, micro_batch)`` over the row groups (sequence-parallel ranks: in turns), in the batch's order."""
        model = self.registry.get(role)
        parts = [out for g in groups for mic, mine in turns(self.c.sequence_parallel, batch.select(g))
                 for out in [fn(model, mic)] if mine]
        out = parts[0].new_empty((len(batch), *parts[0].shape[1:]))
        for g, part in zip(groups, parts):
            out[torch.as_tensor(g, device=out.device)] = part
        return out

    def _update(self, role: str, batch, loss_fn, epochs: int, micro: int, budget: Optional[int]) -> tuple[dict, int]:
        """PPO epochs x mini-batches x micro-batches of one role; returns (metrics, optimizer steps taken)."""
        cfg, step, sp = self.cfg, self.state.get("global_step"), self.c.sequence_parallel
        model = self.registry.get(role)
        metrics, steps = defaultdict(list), 0
        for epoch in range(epochs):
            # the same order on every run of this step (resume-exact), different per step/epoch/role
            gen = torch.Generator().manual_seed(((cfg.trainer.seed * 1_000_003 + step) * 101 + epoch) * 2 + (role == "actor"))
            for mini in batch.split(self.derived.mini_batch_per_rank, generator=gen, shuffle=True):
                groups = micro_batch_groups(mini, micro, budget, share_prompts=self._shares_prompts(role))
                normalizer = self._normalizer(mini)
                shares = {}  # loss metrics: the sum of the micro-batches' shares (sequence parallel: the owner's)
                for i, (mic, mine) in enumerate(t for group in groups for t in turns(sp, mini.select(group))):
                    loss, m = loss_fn(mic, normalizer=normalizer)
                    last = i == len(groups) * (sp.size if sp else 1) - 1
                    skip = self.guard.skip_update(loss, at_boundary=last)
                    result = model.update(mic, {"loss": loss, "skip": skip, "boundary": last})  # backward + step
                    for k, v in (m.items() if mine else ()):
                        if k in LOSS_SHARE_METRICS:
                            shares[k] = shares.get(k, 0.0) + v
                        else:
                            metrics[k].append(v)
                    if result is not None:  # an optimizer step was due
                        self.guard.after_update(role, result, bad_loss=skip)
                        steps += not result["skipped"]
                        if result["grad_norm"] is not None:
                            metrics[f"{role}/grad_norm"].append(result["grad_norm"])
                for k, v in shares.items():
                    metrics[k].append(v)
        out = {k: torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in v]).mean() for k, v in metrics.items()}
        out[f"{role}/lr"] = self.state.get(model.lr_key)
        return out, steps

    def _shares_prompts(self, *roles: str) -> bool:
        """Whether every model of ``roles`` packs shared prompts (then budgets count a prompt once, else row by row)."""
        models = [self.registry.get(r) for r in roles if r in self.registry]
        return bool(models) and all(getattr(m, "shares_prompts", False) for m in models)

    def _normalizer(self, mini) -> torch.Tensor:
        """The mini-batch's global count (tokens or sequences) / DP size: a micro-batch's summed loss over it is its
        share of the exact global mean once DeepSpeed averages gradients over ranks."""
        mask = mini.response_mask
        count = mask.sum() if self.ppo.loss_agg_mode == "token-mean" else mask.any(dim=1).sum()
        return vdist.all_reduce_sum(count.to(torch.float64)).clamp(min=1.0) / self.world

    def _update_kl_controller(self, batch) -> dict:
        """Feed the global token-mean KL (``algos.observed_kl``, summed over ranks) to the controller on rank 0."""
        from verl_ds.algos import kl_penalty, observed_kl

        before = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs  # the sampler's
        kl = kl_penalty(before, batch.ref_log_probs, self.state.get("kl_kind"))
        s, n = vdist.all_reduce_sum(torch.stack(observed_kl(kl, batch.response_mask))).tolist()
        current = s / max(n, 1.0)
        if self.is_main and math.isfinite(current):  # a NaN KL would poison kl_coef for good
            self.ppo.update(batch, {"observed_kl": current, "n_samples": len(batch) * self.world})
        return {"kl_ctrl/observed": current, "kl_ctrl/target": self.state.get("target_kl")}

    # ------------------------------------------------------------------ the loop

    def evaluate(self) -> dict:
        from verl_ds.evaluation import evaluate

        return evaluate(self.run, self.c.val_set)

    def started(self) -> None:
        if self.is_main and self.cfg.server.enabled:  # a change is announced for a step of the restored run
            env = self.cfg.agent.environment
            self.server = start_control_server(self.cfg.server, self.state, self.registry, self.out_dir,
                                               self.metrics.snapshot, self.boundary if env is None
                                               else ScoredByEnvironment(env), len(self.tokenizer))

    def progress(self, metrics: dict) -> dict:
        return {"score": f"{metrics.get('rollout/score/mean', float('nan')):.3f}",
                "kl": f"{metrics.get('kl_ctrl/observed', 0.0):.3f}"}

    def summarize(self, start, elapsed, tokens, export_dir, first, last) -> dict:
        # the rows come from <output_dir>/metrics.jsonl, the whole run's (summarize reads it)
        return summarize([], self.global_step, elapsed, tokens, self.out_dir, export_dir,
                         plot="plot" in self.cfg.trainer.loggers, write=self.is_main, resumed_from=start)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict:
        """SharedState, model states, the active reward, the sampler, the guard (and the async queues: collective)."""
        reg = self.registry
        return {"shared_state": self.state.state_dict(), "global_step": self.global_step,
                "models": {name: reg.get(name).state_dict() for name in reg.names()},
                "registry_versions": reg.versions(), "reward_spec": self.boundary.reward_spec,
                "sampler": self.c.sampler.state_dict(), "reliability": self.guard.state_dict(),
                **({} if (source := self.rollout_source.state_dict()) is None else {"async": source})}

    def load_checkpoint_state(self, saved: dict) -> int:
        from verl_ds.resolved_config import initial_state

        st = self.state
        st.load_state_dict(saved["shared_state"])
        if self.is_main:
            for key, value in initial_state(self.cfg).items():
                if st.get(key) != value:
                    log.info("resume: %s = %r from the checkpoint (a hot value) wins over the config's %r", key,
                             st.get(key), value)
        spec = saved.get("reward_spec")
        if spec and spec != self.boundary.reward_spec:  # a reward swapped over HTTP before the checkpoint
            if self.is_main:
                log.info("resume: the reward active at the checkpoint (%s) wins over the config's", spec)
            self.boundary.restore(spec)  # checked and tried like a swap: one that fails now is refused, not fatal
        for name, sd in saved["models"].items():
            if name in self.registry:
                self.registry.get(name).load_state_dict(sd)
        self.registry.restore_versions({k: v for k, v in saved["registry_versions"].items() if k in self.registry})
        self.c.sampler.load_state_dict(saved["sampler"])
        self.guard.load_state_dict(saved.get("reliability", {}))
        self.rollout_source.load_state_dict(saved.get("async"))
        # the generation replica still holds the weights it last copied (a fallback replaced them): copy them again
        self.registry.get("actor").rollout_engine.refresh()
        step = int(saved["global_step"])
        self.boundary.schedule_replay(step)
        return step

    def export(self, directory: str) -> str:
        """The trained actor per ``trainer.export`` (merged when it is none), written by rank 0, and the tokenizer."""
        from verl_ds.export import export_actor, export_format

        export_actor(self.actor_engine.module, self.tokenizer, directory, export_format(self.cfg),
                     base_model_path=self.cfg.model.path)
        return directory

    def close(self, code: int = 0) -> None:
        """Stop async generation (split ranks exit with ``code``), server, rollout engine; flush logs (idempotent)."""
        self.rollout_source.close(code)  # first: the generation thread may use the engine
        close_sampler = getattr(self.registry.get("actor").rollout_engine, "close", None)
        if close_sampler is not None:  # vLLM's shutdown destroys its groups: before vdist.shutdown() ends ours
            close_sampler()
        if self.server is not None:
            self.server.stop()
            self.server = None
        # changes still staged: dropped (audited) when the run is complete, else journaled for a resume
        self.boundary.close(completed=self.state.get("global_step") >= self.cfg.trainer.total_steps)
        super().close(code)
