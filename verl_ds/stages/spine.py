"""The supervised-style jobs (SFT, reward model, DPO): the RL job's engines and data order around one loss, under
the loop every job runs (``runtime.job.Job``). A stage subclasses ``StageJob`` and fills in its hooks
(docs/stages.md, "A stage of your own")."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any, NamedTuple, Optional

import torch

from verl_ds import dist as vdist
from verl_ds.config import Config
from verl_ds.metrics import reduce_metrics
from verl_ds.runtime.job import Job
from verl_ds.stages.gate import check_stage

log = logging.getLogger(__name__)


class StageData(NamedTuple):
    """The tokenizer and a stage's (train, val) rows (as ``verl_ds.data.PromptDataset``); val may be None."""
    tokenizer: Any
    train: Any
    val: Any


class StageJob(Job):
    """One supervised-style job on the RL job's engines, under ``runtime.job.Job``'s loop; a stage overrides the
    hooks below."""

    name = "stage"  # metric prefix, progress bar, checkpoint kind
    section: Optional[str] = None  # the config section of the job's own keys (sft, rm, dpo: its completion limit)
    export_name = "hf_actor"  # the export's directory under trainer.output_dir
    lora_task_type: Optional[str] = "CAUSAL_LM"  # peft's task type of the adapters of a model from build_model
    packs_rows = True  # False: padded batches whatever model.remove_padding says (a loss whose forward is not packed)

    def __init__(self, cfg: Config, launch: vdist.LaunchInfo, data: Optional[StageData] = None):
        self.kind = self.progress_name = self.name
        super().__init__(cfg, launch, check_stage(cfg, launch.world_size, launch.rank, job=self.section))
        data = type(self).load_data(cfg) if data is None else data
        self.tokenizer, self.train_set, self.val_set = data
        if self.is_main:
            self._report_data()
        from verl_ds.sampler import DistributedPromptSampler

        self.sampler = DistributedPromptSampler(len(self.train_set), cfg.actor.mini_batch_size // self.world,
                                                self.rank, self.world, seed=cfg.trainer.seed)
        self._engines = self._build_engines()
        self.engine = self._engines["actor"]
        from verl_ds.builder import packing_decision

        # packed rows where the model family supports them exactly (a tiny probe forward), padded batches otherwise
        longest = cfg.data.max_prompt_length + getattr(cfg, self.section).max_completion_length if self.section \
            else max(self.row_tokens(x) for x in self.train_set)
        self.packed = packing_decision(cfg.model, self._engines, say=self.is_main, longest=longest,
                                       remove_padding=cfg.model.remove_padding and self.packs_rows)[0]
        self.step = 0
        self.setup()

    @property
    def engines(self) -> dict:
        return self._engines

    @property
    def global_step(self) -> int:
        return self.step

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
        """One optimizer step on this rank's rows of the next global batch (or ``items``); its metrics, all ranks'.
        A non-finite loss on any rank drops the step on every rank (the guard: counted, with a forensic record)."""
        from verl_ds.models.base import optimizer_step

        start = time.perf_counter()
        self.guard.begin_step()
        if items is None:
            items = [self.train_set[i] for i in self.sampler.next_batch()]
        total = vdist.all_reduce_sum(torch.tensor(float(self.units(items)), dtype=torch.float64)).clamp(min=1.0)
        normalizer = total / self.world
        sums, norm = defaultdict(float), None
        groups = self.micro_batches(items)
        for i, group in enumerate(groups):
            loss, parts = self.loss(group, normalizer)
            last = i == len(groups) - 1
            skip = self.guard.skip_update(loss, at_boundary=last)
            result = optimizer_step(self.engine, None, loss, self.cfg.actor.lr, type(self).__name__, skip=skip,
                                    boundary=last)
            if result is not None:  # the optimizer step
                self.guard.after_update("actor", result, bad_loss=skip)
                norm = result["grad_norm"]
            for k, v in parts.items():
                sums[k] = sums[k] + v.detach().to("cpu", torch.float64)
        self.step += 1
        metrics = {f"{self.name}/{k}": v / float(total) for k, v in reduce_metrics(dict(sums), op="sum").items()}
        if norm is not None:
            metrics["actor/grad_norm"] = float(norm)
        metrics.update(self.guard.end_step(self.step, None))
        elapsed = time.perf_counter() - start
        metrics.update({f"{self.name}/units": float(total), "actor/lr": self.cfg.actor.lr,
                        "timing_s/step": reduce_metrics({"t": elapsed}, op="mean")["t"],
                        "training/global_step": self.step})
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """``val/<key>``: each loss metric's global mean over the held-out rows (a contiguous share per rank)."""
        if self.val_set is None:
            return {}
        per = len(self.val_set) // self.world
        if per == 0:
            return {}
        mine = [self.val_set[i] for i in range(self.rank * per, (self.rank + 1) * per)]
        total = vdist.all_reduce_sum(torch.tensor(float(self.units(mine)), dtype=torch.float64)).clamp(min=1.0)
        size, sums = self.cfg.actor.micro_batch_size, defaultdict(float)
        self.engine.eval()
        try:
            for i in range(0, per, size):
                _, parts = self.loss(mine[i:i + size], torch.tensor(1.0, dtype=torch.float64))
                for k, v in parts.items():
                    sums[k] = sums[k] + v.detach().to("cpu", torch.float64)
        finally:
            self.engine.train()
        return {f"val/{k}": v / float(total) for k, v in reduce_metrics(dict(sums), op="sum").items()}

    # ------------------------------------------------------------------ the loop's hooks

    def checkpoint_state(self) -> dict:
        return {"global_step": self.step, "sampler": self.sampler.state_dict(), "reliability": self.guard.state_dict()}

    def load_checkpoint_state(self, saved: dict) -> int:
        self.sampler.load_state_dict(saved["sampler"])
        # "bad_steps": the consecutive count in checkpoints of the stage jobs before they shared the guard
        self.guard.load_state_dict(saved.get("reliability", {"consecutive": saved.get("bad_steps", 0)}))
        self.step = int(saved["global_step"])
        return self.step

    def progress(self, metrics: dict) -> dict:
        return {"loss": f"{metrics.get(f'{self.name}/loss', float('nan')):.4f}"}

    def summarize(self, start, elapsed, tokens, export_dir, first, last) -> dict:
        return {"stage": self.name, "steps": self.step, "resumed_from": start, "time_s": elapsed,
                "val_start": first or None, "val_end": last or None, "export_dir": export_dir,
                "output_dir": self.out_dir}


def format_summary(summary: dict) -> str:
    """One line for the end of a stage's run."""
    name, parts = summary["stage"], [f"steps={summary['steps']}", f"time={summary['time_s']:.1f}s"]
    start, end = summary.get("val_start") or {}, summary.get("val_end") or {}
    for key in sorted(end):
        parts.append(f"{key}={start[key]:.4f}->{end[key]:.4f}" if key in start else f"{key}={end[key]:.4f}")
    if summary.get("export_dir"):
        parts.append(f"export={summary['export_dir']}")
    return f"{name}: " + " ".join(parts)
