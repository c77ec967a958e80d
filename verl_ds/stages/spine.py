"""The job spine of the supervised-style stages (SFT, reward model, DPO): the RL job's config, engines, data order,
checkpoints, metrics and export around one loss. A stage subclasses ``StageJob`` and fills in its hooks
(docs/stages.md, "A stage of your own")."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any, NamedTuple, Optional

import torch

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds.config import Config, write_run_config
from verl_ds.metrics import MetricsLogger, reduce_metrics
from verl_ds.runtime import Preempted, PreemptionHandler, explains_rank_failures
from verl_ds.runtime.run_lock import lock_run_dir
from verl_ds.stages.gate import check_stage, stage_view

log = logging.getLogger(__name__)


class StageData(NamedTuple):
    """The tokenizer and a stage's (train, val) rows (as ``verl_ds.data.PromptDataset``); val may be None."""
    tokenizer: Any
    train: Any
    val: Any


class StageJob:
    """One supervised-style job on the RL job's engines; a stage overrides the hooks."""

    name = "stage"  # metric prefix, progress bar, checkpoint tag
    export_name = "hf_actor"  # the export's directory under trainer.output_dir
    lora_task_type: Optional[str] = "CAUSAL_LM"  # peft's task type of the adapters of a model from build_model
    packs_rows = True  # False: padded batches whatever model.remove_padding says (a loss whose forward is not packed)

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo, data: Optional[StageData] = None):
        self.cfg = cfg
        self.derived = check_stage(cfg, launch.world_size, launch.rank)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.trainer.device == "auto" \
            else cfg.trainer.device
        self.preemption = PreemptionHandler().install()
        vdist.init_distributed(launch, cfg.trainer.dist_timeout_s, self.device)
        self.rank, self.world = vdist.rank(), vdist.world_size()
        self.is_main = self.rank == 0
        vdist.seed_everything(cfg.trainer.seed * 1000 + self.rank)
        self.out_dir = cfg.trainer.output_dir
        self.ckpt_root = os.path.join(self.out_dir, "checkpoints")
        self.run_lock = lock_run_dir(self.out_dir)
        if self.is_main:
            write_run_config(cfg, os.path.join(self.out_dir, "config.yaml"))
        vdist.barrier()
        self.metrics = MetricsLogger(self.out_dir, enabled=self.is_main, tensorboard="tensorboard" in cfg.trainer.loggers,
                                     wandb="wandb" in cfg.trainer.loggers, config=cfg.to_dict())
        data = type(self).load_data(cfg) if data is None else data
        self.tokenizer, self.train_set, self.val_set = data
        if self.is_main:
            self._report_data()
        from verl_ds.sampler import DistributedPromptSampler

        self.sampler = DistributedPromptSampler(len(self.train_set), cfg.actor.mini_batch_size // self.world,
                                                self.rank, self.world, seed=cfg.trainer.seed)
        self.engines = self._build_engines()
        self.engine = self.engines["actor"]
        from verl_ds.builder import _packing_decision

        # packed rows where the model family supports them exactly (a tiny probe forward), padded batches otherwise
        view = stage_view(cfg)
        view.model.remove_padding = cfg.model.remove_padding and self.packs_rows
        self.packed = _packing_decision(view, self.engines, say=self.is_main)[0]
        self.step, self._last_saved, self.bad_steps = 0, None, 0
        self.setup()

    # ------------------------------------------------------------------ hooks

    @classmethod
    def load_data(cls, cfg: Config) -> StageData:
        """The tokenizer and the (train, val) rows; ConfigError naming the key when unusable (the CLI calls it before
        torch.distributed starts, so bad data exits 2)."""
        raise NotImplementedError

    def engine_roles(self) -> tuple:
        """The engines to build: "actor" (trained) and optionally "ref" (frozen, the initial actor, as the RL job's)."""
        return ("actor",)

    def build_model(self, ds_config: dict):
        """The trained model when it is not the configured causal LM (a reward model's classifier); None: that LM."""
        return None

    def setup(self) -> None:
        """Called once the engines are built (``self.engines``, ``self.packed``)."""

    def units(self, items: list) -> int:
        """This rank's count of the loss's unit in ``items`` (completion tokens for SFT, pairs for RM and DPO)."""
        raise NotImplementedError

    def row_tokens(self, item) -> int:
        """A row's tokens, for ``actor.max_tokens_per_micro_batch``."""
        raise NotImplementedError

    def loss(self, items: list, normalizer: torch.Tensor) -> tuple:
        """(loss, sums): the rows' summed loss / ``normalizer`` (the step's global units / world size, so DeepSpeed's
        mean over ranks is the exact global mean), and detached per-unit sums of the metrics to log."""
        raise NotImplementedError

    def export(self, directory: str) -> str:
        """The trained model in HF format (``trainer.export``), the tokenizer with it."""
        from verl_ds.export import export_actor, export_format

        export_actor(self.engine.module, self.tokenizer, directory, export_format(self.cfg),
                     base_model_path=self.cfg.model.path)
        return directory

    # ------------------------------------------------------------------ construction

    def _report_data(self) -> None:
        from verl_ds.data import write_data_report

        for name, ds in (("train", self.train_set), ("val", self.val_set)):
            if ds is not None and sum(ds.report().values()):
                log.warning("%s rows: %s", name, ds.summary())
        write_data_report(self.out_dir, {"train": self.train_set, "val": self.val_set})

    def _build_engines(self) -> dict:
        from verl_ds.config import ConfigError
        from verl_ds.engines.build import build_engines, make_engine
        from verl_ds.engines.ds_config import make_ds_config, uses_gpu
        from verl_ds.weights.lora import LORA_SEED_OFFSET, OUTPUT_HEAD, apply_lora, lora_spec

        cfg, roles = self.cfg, tuple(self.engine_roles())
        lora = lora_spec(cfg, "actor")
        if lora is None and cfg.trainer.export == "adapter":
            raise ConfigError("trainer.export=adapter needs actor.lora_rank > 0 (a fully fine-tuned model has "
                              "no adapters); use trainer.export=merged")
        model = self.build_model(make_ds_config(cfg, self.derived, "actor", gpu=uses_gpu(cfg)))
        if model is None:
            return build_engines(cfg, self.derived, self.tokenizer, roles=roles)
        if roles != ("actor",):
            raise ValueError(f"{type(self).__name__}: build_model gives the trained model; engine_roles must be "
                             f"('actor',), got {roles}")
        if lora is not None:
            if model.get_output_embeddings() is None and OUTPUT_HEAD in lora.target_modules:
                # the default targets name the LM head; a model without one (a classifier, whose head peft trains
                # whole under its task type) gets the rest
                lora = dataclasses.replace(lora, target_modules=tuple(t for t in lora.target_modules
                                                                      if t != OUTPUT_HEAD) or ("all-linear",))
            model = apply_lora(model, lora, seed=cfg.model.init_seed + LORA_SEED_OFFSET["actor"],
                               task_type=self.lora_task_type)
        a = cfg.actor
        return {"actor": make_engine(model, cfg, self.derived, "actor", lr=a.lr, weight_decay=a.weight_decay,
                                     grad_clip=a.grad_clip)}

    # ------------------------------------------------------------------ one step

    def micro_batches(self, items: list) -> list:
        """This rank's rows in micro-batches of rows or of a token budget (the same count on every rank)."""
        from verl_ds.packing import agree_num_micro_batches, count_micro_batches, token_budget_micro_batches

        budget, size = self.cfg.actor.max_tokens_per_micro_batch, self.cfg.actor.micro_batch_size
        if budget is None:
            return [items[i:i + size] for i in range(0, len(items), size)]
        lengths = [self.row_tokens(x) for x in items]
        groups = token_budget_micro_batches(lengths, budget, agree_num_micro_batches(count_micro_batches(lengths, budget)))
        return [[items[i] for i in g] for g in groups]

    def train_step(self, items: Optional[list] = None) -> dict:
        """One optimizer step on this rank's rows of the next global batch (or ``items``); its metrics, all ranks'."""
        from verl_ds.models.base import optimizer_step

        start = time.perf_counter()
        if items is None:
            items = [self.train_set[i] for i in self.sampler.next_batch()]
        total = vdist.all_reduce_sum(torch.tensor(float(self.units(items)), dtype=torch.float64)).clamp(min=1.0)
        normalizer = total / self.world
        sums, result, losses, skip = defaultdict(float), None, [], False
        groups = self.micro_batches(items)
        for i, group in enumerate(groups):
            loss, parts = self.loss(group, normalizer)
            last = i == len(groups) - 1
            losses.append(loss.detach().reshape(()).float())
            # a non-finite loss on any rank drops the whole step on every rank (optimizer_step: NaN gradients under
            # ZeRO, which DeepSpeed's overflow check skips; dropped gradients at stage 0)
            skip = last and vdist.any_rank(not bool(torch.isfinite(torch.stack(losses)).all()))
            result = optimizer_step(self.engine, None, loss, self.cfg.actor.lr, type(self).__name__, skip=skip,
                                    boundary=last) or result
            for k, v in parts.items():
                sums[k] = sums[k] + v.detach().to("cpu", torch.float64)
        self.step += 1
        metrics = {f"{self.name}/{k}": v / float(total) for k, v in reduce_metrics(dict(sums), op="sum").items()}
        norm = result.get("grad_norm") if result else None
        if norm is not None:
            metrics["actor/grad_norm"] = float(norm)
        self._check_finite(skip, result, norm, metrics)
        elapsed = time.perf_counter() - start
        metrics.update({f"{self.name}/units": float(total), "actor/lr": self.cfg.actor.lr,
                        "timing_s/step": reduce_metrics({"t": elapsed}, op="mean")["t"],
                        "training/global_step": self.step})
        return metrics

    def _check_finite(self, skip: bool, result: Optional[dict], norm, metrics: dict) -> None:
        """Count a step whose loss or gradient norm was not finite (update skipped); NonFiniteError if one was applied."""
        from verl_ds.runtime import NonFiniteError

        bad = skip or (norm is not None and not torch.isfinite(torch.as_tensor(float(norm))))
        if bad and result is not None and not result["skipped"]:
            raise NonFiniteError(f"step {self.step}: DeepSpeed applied an update from non-finite gradients (zero stage "
                                 f"{result.get('zero_stage')}); resume from the last checkpoint", None)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        metrics["training/skipped_step"] = float(bad)
        if bad:
            log.warning("step %d: non-finite loss or gradient norm: update skipped (%d consecutive of at most "
                        "trainer.max_bad_steps=%d)", self.step, self.bad_steps, self.cfg.trainer.max_bad_steps)

    @torch.no_grad()
    def validate(self) -> dict:
        """``val/<key>``: each loss metric's global mean over the held-out rows (a contiguous share per rank)."""
        if self.val_set is None:
            return {}
        per = len(self.val_set) // self.world
        if per == 0:
            return {}
        mine = [self.val_set[i] for i in range(self.rank * per, (self.rank + 1) * per)]
        total = vdist.all_reduce_sum(torch.tensor(float(self.units(mine)), dtype=torch.float64)).clamp(min=1.0)
        size, sums = self.cfg.rollout.log_prob_micro_batch_size, defaultdict(float)
        self.engine.eval()
        try:
            for i in range(0, per, size):
                _, parts = self.loss(mine[i:i + size], torch.tensor(1.0, dtype=torch.float64))
                for k, v in parts.items():
                    sums[k] = sums[k] + v.detach().to("cpu", torch.float64)
        finally:
            self.engine.train()
        return {f"val/{k}": v / float(total) for k, v in reduce_metrics(dict(sums), op="sum").items()}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> str:
        """A complete checkpoint: the trained engines, every rank's RNG, the step and the data position."""
        state = {"global_step": self.step, "stage": self.name, "sampler": self.sampler.state_dict(),
                 "bad_steps": self.bad_steps}
        path = ckpt.save(self.ckpt_root, self.step, self.engines, state, keep_last=self.cfg.trainer.keep_last,
                         digest=self.cfg.trainer.checkpoint_digest)
        self._last_saved = self.step
        return path

    def _restore(self, _job, step_dir: str, verify: bool = True) -> int:
        from verl_ds.resume import verify_mode

        saved = ckpt.load(step_dir, self.engines, verify=verify_mode(step_dir) if verify else None,
                          seed=self.cfg.trainer.seed)
        if saved.get("stage") != self.name:
            raise ckpt.CheckpointError(f"{step_dir} was written by the {saved.get('stage') or 'RL (train)'} job, not "
                                       f"by {self.name}; give this job its own trainer.output_dir, or resume=none")
        self.sampler.load_state_dict(saved["sampler"])
        self.bad_steps = int(saved.get("bad_steps", 0))
        self.step = self._last_saved = int(saved["global_step"])
        self.metrics.truncate_after(self.step)
        if self.is_main:
            log.info("resumed from %s (step %d)", step_dir, self.step)
        return self.step

    def _stop_for_preemption(self, signal_name: str) -> None:
        if self.step > 0 and self._last_saved != self.step:
            self.save_checkpoint()
        saved = os.path.join(self.ckpt_root, f"global_step_{self.step}") if self.step > 0 else None
        self.close()
        exc = Preempted(signal_name, self.step, saved)
        if self.is_main:
            print(f"[rank{self.rank}] {exc.message}", flush=True)
        vdist.barrier()
        raise exc

    # ------------------------------------------------------------------ the loop

    @explains_rank_failures
    def fit(self) -> dict:
        """Run (or resume) until ``trainer.total_steps``; checkpoint, export; returns a summary."""
        from tqdm.auto import tqdm

        from verl_ds.resume import maybe_resume

        cfg, t0 = self.cfg, time.perf_counter()
        first = last = None
        try:
            start = maybe_resume(self, restore=self._restore)
            self.step = start
            if start == 0:
                first = self.validate()
                if first:
                    self.metrics.log(0, first)
            bar = tqdm(total=cfg.trainer.total_steps, initial=start, desc=self.name, dynamic_ncols=True,
                       disable=not (self.is_main and "progress_bar" in cfg.trainer.loggers))
            while self.step < cfg.trainer.total_steps:
                signal_name = self.preemption.stop_requested()  # collective: every rank stops at the same step
                if signal_name:
                    self._stop_for_preemption(signal_name)
                metrics = self.train_step()
                every = cfg.trainer.val_every
                if self.step == cfg.trainer.total_steps or (every and self.step % every == 0):
                    last = self.validate()
                    metrics.update(last)
                self.metrics.log(self.step, metrics)
                if self.bad_steps >= cfg.trainer.max_bad_steps:
                    from verl_ds.runtime import NonFiniteError

                    raise NonFiniteError(f"{self.bad_steps} consecutive steps with a non-finite loss or gradient norm "
                                         f"(trainer.max_bad_steps={cfg.trainer.max_bad_steps}), each update skipped; "
                                         "check the data, actor.lr and model.dtype, then resume from the last "
                                         "checkpoint", None)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics.get(f'{self.name}/loss', float('nan')):.4f}")
                if cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0:
                    self.save_checkpoint()
            bar.close()
            if self._last_saved != self.step:
                self.save_checkpoint()
            export_dir = self.export(os.path.join(self.out_dir, self.export_name)) if cfg.trainer.export != "none" else None
        except BaseException:
            self.close()
            raise
        summary = {"stage": self.name, "steps": self.step, "resumed_from": start, "time_s": time.perf_counter() - t0,
                   "val_start": first, "val_end": last, "export_dir": export_dir, "output_dir": self.out_dir}
        self.close()
        return summary

    def close(self) -> None:
        """Uninstall the signal handlers, flush the loggers, release the run directory; safe to call twice."""
        self.preemption.uninstall()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None


def format_summary(summary: dict) -> str:
    """One line for the end of a stage's run."""
    name, parts = summary["stage"], [f"steps={summary['steps']}", f"time={summary['time_s']:.1f}s"]
    start, end = summary.get("val_start") or {}, summary.get("val_end") or {}
    for key in sorted(end):
        parts.append(f"{key}={start[key]:.4f}->{end[key]:.4f}" if key in start else f"{key}={end[key]:.4f}")
    if summary.get("export_dir"):
        parts.append(f"export={summary['export_dir']}")
    return f"{name}: " + " ".join(parts)
