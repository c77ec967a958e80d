"""The trainer spine: ``fit`` runs ``train_step`` until ``trainer.total_steps``.
A step is these phases in order, each one call under the timer ``timing_s/<phase>``: boundary (hot changes), gen,
reward, old_log_prob, ref and values (only when needed), adv, update_critic, update_actor, weight_sync, kl_ctrl.
Construction is ``verl_ds.builder.build``; the numerics are ``verl_ds.algos``; checkpoints ``verl_ds.checkpoint``."""
from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.asyncrl.split import make_async_rollout
from verl_ds.batch import REQUIRED_FOR_LOSS
from verl_ds.builder import build, build_reward
from verl_ds.config import Config, write_run_config
from verl_ds.step_boundary import StepBoundary, start_control_server
from verl_ds.metrics import MetricsLogger, Timings, reduce_metrics, sample_means_over_ranks
from verl_ds.models.ppo import LOSS_SHARE_METRICS
from verl_ds.models.sequence_parallel import turns
from verl_ds.packing import micro_batch_groups
from verl_ds.report import summarize
from verl_ds.reward_trial import check_swap_rows, trial
from verl_ds.reward_spec import parse_reward_swap
from verl_ds.rollout import SamplingError, collect, rollout_and_score, sampler_mismatch
from verl_ds.run.startup import check_startup
from verl_ds.runtime import (NonFiniteError, NonFiniteGuard, PreemptionHandler, StepFailed, explains_rank_failures,
                             raise_if_any_rank_failed)
from verl_ds.runtime.preemption import stop_for_preemption
from verl_ds.runtime.run_lock import lock_run_dir

log = logging.getLogger(__name__)


class Trainer:
    """Builds a run from a ``Config`` (``verl_ds.builder``) and runs ``fit()``."""

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo, data=None):
        self.cfg = cfg
        self.derived = check_startup(cfg, launch.world_size, launch.rank)  # one gate: fails before any model is built
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.trainer.device == "auto" else cfg.trainer.device
        self.preemption = PreemptionHandler().install()  # SIGTERM/USR1/INT/HUP: checkpoint, exit 75
        vdist.init_distributed(launch, cfg.trainer.dist_timeout_s, self.device)
        self.rank, self.world = vdist.rank(), vdist.world_size()
        self.is_main = self.rank == 0
        vdist.seed_everything(cfg.trainer.seed * 1000 + self.rank)
        self.out_dir = cfg.trainer.output_dir
        self.ckpt_root = os.path.join(self.out_dir, "checkpoints")
        self.run_lock = lock_run_dir(self.out_dir)  # a second job on this directory is refused, naming the first
        if self.is_main:
            write_run_config(cfg, os.path.join(self.out_dir, "config.yaml"))  # secrets redacted, mode 0600
        vdist.barrier()
        self.metrics = MetricsLogger(self.out_dir, enabled=self.is_main, tensorboard="tensorboard" in cfg.trainer.loggers,
                                     wandb="wandb" in cfg.trainer.loggers, config=cfg.to_dict())
        self.guard = NonFiniteGuard(cfg.trainer.max_bad_steps, self.out_dir, self.rank, self.world)
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
        self.asyncrl = make_async_rollout(self)  # rollout.mode one_step_off / streaming: a generation thread
        self._listeners, self._last_saved = [], None  # event listeners; the step last checkpointed (or None)
        self.server = None  # started by fit() once the run's state is restored: a change is announced for its step

    @property
    def actor_engine(self):
        return self.c.engines["actor"]

    def add_event_listener(self, fn) -> None:
        """``fn(event, step)`` is called at ``step_begin`` and at the checkpoint's points (tests inject faults)."""
        self._listeners.append(fn)

    def _emit(self, event: str, step: int) -> None:
        for fn in self._listeners:
            fn(event, step)

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
        rollout, error, algo = None, None, cfg.algo
        sampling = {k: hot[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        data_position = None if hasattr(self.asyncrl, "unwind") else self.c.sampler.state_dict()  # see _abandon
        try:
            rollout = self.asyncrl.next_rollout(step, t) if self.asyncrl else collect(  # rollout.mode (asyncrl)
                self._prompts, self.registry.get("actor"), self.registry.get("reward"), tok, sampling=sampling,
                n=cfg.rollout.n, timings=t, dynamic=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                overlong=(algo.overlong_buffer, algo.overlong_penalty_factor),
                greedy_baseline=self.ppo.needs_baseline, rollout_fn=self.rollout_fn)
        except SamplingError as exc:  # non-finite logits: skip the step everywhere, with a forensic record
            self.guard.sampling_error = str(exc)
        except Exception as exc:  # e.g. a reward function failing on one rank: every rank must stop together
            error = exc
        try:
            raise_if_any_rank_failed(error, f"step {step} failed before any update")
        except StepFailed:  # the fault's checkpoint is of the step before, and resumes with this step's prompts
            self._abandon(step, data_position)
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
            if self.ppo.needs_critic:
                with t("values"):
                    chunks = micro_batch_groups(batch, cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch)
                    batch.values = self._no_grad_pass("critic", batch, chunks, lambda m, b: m.get_values(
                        b.observation, b.mask, b.response_width))
        baseline = batch.extras.get("baseline_score")
        with t("adv"):  # the reward metrics of the rows trained, over every rank's (also across a reward swap)
            metrics = {**rollout.metrics, **sample_means_over_ranks(rollout.per_sample), **self.ppo.compute_advantage(
                batch, whiten_fn=vdist.global_masked_whiten,
                baseline_scores=None if baseline is None else torch.tensor(baseline, device=batch.scores.device))}
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
                (self.asyncrl or self.registry.get("actor").rollout_engine).refresh()
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

    def _prompts(self) -> dict:
        """This rank's prompts for the step, collated and on the engines' device."""
        from verl_ds.data import collate_prompts

        items = [self.c.train_set[i] for i in self.c.sampler.next_batch()]
        return collate_prompts(items, self.tokenizer.pad_token_id, self.actor_engine.device)

    def _abandon(self, step: int, data_position: Optional[dict]) -> None:
        """Undo a step that failed before any update (collective): its count, and its prompts go back."""
        self.boundary.uncross(step)
        if data_position is None:  # a colocated generation thread draws ahead from the sampler: its groups go back
            self.asyncrl.unwind()
        else:
            self.c.sampler.load_state_dict(data_position)

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

        return evaluate(self)

    @explains_rank_failures  # a dead or silent rank: RankFailure saying so, not a bare gloo error
    def fit(self) -> dict:
        """Run until ``trainer.total_steps``; returns a summary (reward before/after, time, tokens/s)."""
        from tqdm.auto import tqdm

        from verl_ds.resume import fall_back_after_resume, maybe_resume, save_checkpoint

        cfg = self.cfg
        try:
            resumed = start = maybe_resume(self)
            if self.is_main and cfg.server.enabled:
                self.server = start_control_server(self)
            if start == 0:
                self.metrics.log(0, self.evaluate())
            t0, tokens, fell_back = time.perf_counter(), 0.0, False
            self._last_saved = start or None  # a resumed run with nothing left to do re-saves nothing
            bar = tqdm(total=cfg.trainer.total_steps, initial=start, desc=cfg.algo.adv_estimator, dynamic_ncols=True,
                       disable=not (self.is_main and "progress_bar" in cfg.trainer.loggers))
            while self.state.get("global_step") < cfg.trainer.total_steps:
                signal_name = self.preemption.stop_requested()  # collective: every rank stops at the same step
                if signal_name:
                    stop_for_preemption(self, signal_name)  # checkpoint, then exit 75 (the sbatch script requeues)
                metrics = self.train_step()
                step = int(metrics["training/global_step"])
                tokens += metrics.get("perf/total_num_tokens", 0.0)
                val_every = cfg.trainer.val_every
                if step == cfg.trainer.total_steps or (val_every and step % val_every == 0):
                    metrics.update(self.evaluate())
                self.metrics.log(step, metrics)
                try:
                    self.guard.raise_if_exhausted()  # NonFiniteError after trainer.max_bad_steps bad steps in a row
                except NonFiniteError:
                    if fell_back or not fall_back_after_resume(self, step, resumed):  # once, right after a resume
                        raise
                    resumed = self._last_saved = bar.n = self.state.get("global_step")
                    fell_back = True
                    continue
                bar.update(1)
                bar.set_postfix(score=f"{metrics.get('rollout/score/mean', float('nan')):.3f}",
                                kl=f"{metrics.get('kl_ctrl/observed', 0.0):.3f}")
                if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
                    save_checkpoint(self)
                    self._last_saved = step
            bar.close()
            if self._last_saved != self.state.get("global_step"):
                save_checkpoint(self)
            export_dir = self.export_hf() if cfg.trainer.export != "none" else None
        except (NonFiniteError, StepFailed):  # every rank raised here: save what was trained so far, then end
            step = self.state.get("global_step")
            if step > 0 and self._last_saved != step:
                log.error("the run is ending on a fault at step %d: checkpoint %s written first", step,
                          save_checkpoint(self))
            self.close(code=1)
            raise
        except BaseException:
            self.close(code=1)
            raise
        # the rows come from <output_dir>/metrics.jsonl, the whole run's (summarize reads it)
        summary = summarize([], self.state.get("global_step"), time.perf_counter() - t0, tokens,
                            self.out_dir, export_dir, plot="plot" in cfg.trainer.loggers, write=self.is_main, resumed_from=start)
        self.close()
        return summary

    def export_hf(self, directory: Optional[str] = None) -> str:
        """The trained actor per ``trainer.export`` (merged when it is none), written by rank 0, and the tokenizer."""
        from verl_ds.export import export_actor, export_format

        directory = directory or os.path.join(self.out_dir, "hf_actor")
        export_actor(self.actor_engine.module, self.tokenizer, directory, export_format(self.cfg),
                     base_model_path=self.cfg.model.path)
        return directory

    def close(self, code: int = 0) -> None:
        """Stop async generation (split ranks exit with ``code``), server, rollout engine; flush logs (idempotent)."""
        self.preemption.uninstall()
        getattr(self.asyncrl, "close", lambda code: None)(code)  # first: the generation thread may use the engine
        close_sampler = getattr(self.registry.get("actor").rollout_engine, "close", None)
        if close_sampler is not None:  # vLLM's shutdown destroys its groups: before vdist.shutdown() ends ours
            close_sampler()
        if self.server is not None:
            self.server.stop()
            self.server = None
        # changes still staged: dropped (audited) when the run is complete, else journaled for a resume
        self.boundary.close(completed=self.state.get("global_step") >= self.cfg.trainer.total_steps)
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
