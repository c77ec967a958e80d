"""Metrics: named timers, cross-rank reduction, and the loggers (metrics.jsonl; TensorBoard / wandb when enabled).
Keys follow verl's (``actor/pg_loss``, ``timing_s/gen``, ...) so existing dashboards work unchanged."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


class Timings:
    """``with timings("gen"):`` records seconds under ``timing_s/gen``."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def as_metrics(self) -> dict:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def reduce_metrics(metrics: dict, op: str = "mean") -> dict:
    """Average (or sum) scalar metrics over ranks in one collective and host sync; every rank passes the same keys."""
    if not metrics:
        return {}
    from verl_ds.dist import all_reduce_sum, world_size

    keys = sorted(metrics)
    # python numbers stay float64 (a float32 detour would log kl_coef 0.2 as 0.20000000298)
    t = torch.stack([v.detach().to("cpu", torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                     else torch.tensor(float(v), dtype=torch.float64) for v in (metrics[k] for k in keys)])
    t = all_reduce_sum(t)  # a no-op at world size 1
    if op == "mean":
        t /= world_size()
    return dict(zip(keys, t.tolist()))


def sample_means_over_ranks(per_sample: dict) -> dict:
    """Collective: each per-sample metric's mean over every rank's samples that have it; every rank gets all names,
    as ``reduce_metrics`` pairs by sorted name (some ranks may lack one around a reward swap in async generation)."""
    from verl_ds.dist import all_reduce_sum, gather_object

    keys = sorted(set().union(*gather_object(sorted(per_sample))))
    if not keys:
        return {}
    local = [(per_sample[k].detach().to("cpu", torch.float64).sum(), float(per_sample[k].numel()))
             if k in per_sample else (torch.zeros((), dtype=torch.float64), 0.0) for k in keys]
    sums = all_reduce_sum(torch.stack([torch.stack([s, torch.tensor(n, dtype=torch.float64)]) for s, n in local]))
    return {k: sums[i, 0] / sums[i, 1] for i, k in enumerate(keys)}


class MetricsLogger:
    """Rank 0 writes one JSON line per step to ``metrics.jsonl`` and keeps the latest values for /metrics."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool = False, wandb: bool = False,
                 config: dict | None = None):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.latest: dict = {}
        self._lock = threading.Lock()
        self._tb = self._wandb = None
        if not enabled:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:
                log.warning("trainer.loggers lists tensorboard, but tensorboard is not installed; skipping it")
        if wandb:
            try:
                import wandb as _wandb

                self._wandb = _wandb.init(project="verl_ds", dir=output_dir, config=config or {}, resume="allow")
            except ImportError:
                log.warning("trainer.loggers lists wandb, but wandb is not installed; skipping it")

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps that ran after the checkpoint (they are trained again)."""
        if not (self.enabled and os.path.isfile(self.path)):
            return
        from verl_ds.report import read_metrics_file  # a last line cut by the crash is dropped

        kept = [row for row in read_metrics_file(self.path) if row.get("step", 0) <= step]
        with open(self.path, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in kept)

    def log(self, step: int, metrics: dict) -> None:
        with self._lock:
            self.latest = {"step": step, **metrics}
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.latest)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
