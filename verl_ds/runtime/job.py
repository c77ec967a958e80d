"""The one training loop of every job (the RL trainer, SFT, RM, DPO): run directory and lock, seeding, metrics,
preemption, the non-finite guard, resume (also at another world size), checkpoint cadence, export and close. A job
subclasses ``Job`` and supplies its step and its checkpoint state (docs/stages.md, "A stage of your own")."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from verl_ds import checkpoint as ckpt
from verl_ds import dist as vdist
from verl_ds.config import Config, write_run_config
from verl_ds.metrics import MetricsLogger
from verl_ds.runtime.nonfinite import NonFiniteError, NonFiniteGuard
from verl_ds.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from verl_ds.runtime.rank_failure import StepFailed, explains_rank_failures
from verl_ds.runtime.run_lock import lock_run_dir

log = logging.getLogger(__name__)


class Job:
    """A job on ``trainer.output_dir``: built from a checked config (``derived``: its sizes), run by ``fit()``."""

    kind = "train"  # written into checkpoints: a job resumes only its own kind's
    progress_name = "train"  # the progress bar's label
    export_name = "hf_actor"  # the export's directory under trainer.output_dir

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo, derived):
        self.cfg, self.derived = cfg, derived
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.trainer.device == "auto" \
            else cfg.trainer.device
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
        self._listeners, self._last_saved = [], None  # event listeners; the step last checkpointed (or None)

    # ------------------------------------------------------------------ what a job supplies

    @property
    def global_step(self) -> int:
        raise NotImplementedError

    @property
    def engines(self) -> dict:
        """The DeepSpeed engines a checkpoint holds, by role."""
        raise NotImplementedError

    def train_step(self) -> dict:
        """One step on every rank: its metrics (reduced across ranks), ``training/global_step`` among them."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        return {}

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds beyond the engines and RNG (JSON-safe)."""
        raise NotImplementedError

    def load_checkpoint_state(self, saved: dict) -> int:
        """Restore ``checkpoint_state``'s part; returns the checkpoint's step."""
        raise NotImplementedError

    def export(self, directory: str) -> str:
        """The trained model in HF format (``trainer.export``) into ``directory``; returns it."""
        raise NotImplementedError

    def started(self) -> None:
        """Called once the run's state is restored, before the first step."""

    def progress(self, metrics: dict) -> dict:
        """The progress bar's figures of a step."""
        return {}

    def summarize(self, start: int, elapsed: float, tokens: float, export_dir: Optional[str], first: dict,
                  last: dict) -> dict:
        raise NotImplementedError

    def close(self, code: int = 0) -> None:
        """Uninstall the signal handlers, flush the loggers, release the run directory; safe to call twice."""
        self.preemption.uninstall()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    # ------------------------------------------------------------------ checkpoints

    def add_event_listener(self, fn) -> None:
        """``fn(event, step)`` is called at ``step_begin`` and at the checkpoint's points (tests inject faults)."""
        self._listeners.append(fn)

    def _emit(self, event: str, step: int) -> None:
        for fn in self._listeners:
            fn(event, step)

    def save_checkpoint(self) -> str:
        """A complete checkpoint of the current step (collective); the checkpoint's points reach the listeners."""
        step = self.global_step
        path = ckpt.save(self.ckpt_root, step, self.engines, {**self.checkpoint_state(), "job": self.kind},
                         keep_last=self.cfg.trainer.keep_last, on_event=lambda point: self._emit(point, step),
                         digest=self.cfg.trainer.checkpoint_digest)
        self._last_saved = step
        return path

    def restore(self, step_dir: str, verify: bool = True) -> int:
        """Restore everything from ``step_dir`` (collective; ``verify=False``: the caller verified it); its step.
        Another world size is fine (DeepSpeed's universal checkpoint; data order and RNG: ``verl_ds.checkpoint``)."""
        from verl_ds.resume import verify_mode

        saved = ckpt.load(step_dir, self.engines, verify=verify_mode(step_dir) if verify else None,
                          seed=self.cfg.trainer.seed)
        written_by = saved.get("job") or saved.get("stage") or "train"  # "stage": checkpoints of the stage jobs before
        if written_by != self.kind:
            raise ckpt.CheckpointError(f"{step_dir} was written by the {_job_name(written_by)} job, not by "
                                       f"{_job_name(self.kind)}; give this job its own trainer.output_dir, or "
                                       "resume=none")
        step = self.load_checkpoint_state(saved)
        self._last_saved = step
        self.metrics.truncate_after(step)
        if self.is_main:
            log.info("resumed from %s (step %d)", step_dir, step)
        return step

    def stop_for_preemption(self, signal_name: str) -> None:
        """Checkpoint the finished steps (if the last checkpoint is older), close, and raise Preempted (exit 75)."""
        step = self.global_step
        if step > 0 and self._last_saved != step:
            self.save_checkpoint()
        saved = os.path.join(self.ckpt_root, f"global_step_{step}") if step > 0 else None
        self.close(code=PREEMPTED_EXIT_CODE)  # split placement: the generation ranks exit 75 as well
        exc = Preempted(signal_name, step, saved)
        if self.is_main or self.preemption.received:
            print(f"[rank{self.rank}] {exc.message}", flush=True)
        vdist.barrier()
        raise exc

    # ------------------------------------------------------------------ the loop

    @explains_rank_failures  # a dead or silent rank: RankFailure saying so, not a bare gloo error
    def fit(self) -> dict:
        """Run (or resume) until ``trainer.total_steps``; checkpoint, export; returns the job's summary."""
        from tqdm.auto import tqdm

        from verl_ds.resume import fall_back_after_resume, maybe_resume

        cfg, t0, tokens, first, last = self.cfg, time.perf_counter(), 0.0, {}, {}
        try:
            resumed = start = maybe_resume(self)
            self._last_saved = start or None  # a resumed run with nothing left to do re-saves nothing
            self.started()
            if start == 0:
                first = self.evaluate()
                if first:
                    self.metrics.log(0, first)
            fell_back, total = False, cfg.trainer.total_steps
            bar = tqdm(total=total, initial=start, desc=self.progress_name, dynamic_ncols=True,
                       disable=not (self.is_main and "progress_bar" in cfg.trainer.loggers))
            while self.global_step < total:
                signal_name = self.preemption.stop_requested()  # collective: every rank stops at the same step
                if signal_name:
                    self.stop_for_preemption(signal_name)  # the sbatch script requeues on 75
                metrics = self.train_step()
                step = int(metrics["training/global_step"])
                tokens += metrics.get("perf/total_num_tokens", 0.0)
                every = cfg.trainer.val_every
                if step == total or (every and step % every == 0):
                    last = self.evaluate()
                    metrics.update(last)
                self.metrics.log(step, metrics)
                try:
                    self.guard.raise_if_exhausted()  # NonFiniteError after trainer.max_bad_steps bad steps in a row
                except NonFiniteError:
                    if fell_back or not fall_back_after_resume(self, step, resumed):  # once, right after a resume
                        raise
                    resumed = self._last_saved = bar.n = self.global_step
                    fell_back = True
                    continue
                bar.update(1)
                bar.set_postfix(**self.progress(metrics))
                if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
                    self.save_checkpoint()
            bar.close()
            if self._last_saved != self.global_step:
                self.save_checkpoint()
            export_dir = None if cfg.trainer.export == "none" else \
                self.export(os.path.join(self.out_dir, self.export_name))
        except (NonFiniteError, StepFailed):  # every rank raised here: save what was trained so far, then end
            step = self.global_step
            if step > 0 and self._last_saved != step:
                log.error("the run is ending on a fault at step %d: checkpoint %s written first", step,
                          self.save_checkpoint())
            self.close(code=1)
            raise
        except BaseException:
            self.close(code=1)
            raise
        summary = self.summarize(start, time.perf_counter() - t0, tokens, export_dir, first, last)
        self.close()
        return summary


def _job_name(kind: str) -> str:
    return "RL (train)" if kind == "train" else kind
