"""The end-of-run report: reward of the first vs last 10% of steps, validation, throughput, the reward curve."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)


def summarize(history: list[dict], steps: int, elapsed: float, tokens: float, output_dir: str,
              export_dir: Optional[str], plot: bool, write: bool) -> dict:
    """The summary dict (also ``summary.json`` when ``write``) from the metrics.jsonl history."""
    train = [h for h in history if "critic/score/mean" in h]
    val = [(h["step"], h["val/score/mean"]) for h in history if "val/score/mean" in h]
    out = {"steps": steps, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
           "export_dir": export_dir, "output_dir": output_dir}
    if train:
        k = max(1, len(train) // 10)
        scores = [h["critic/score/mean"] for h in train]
        out.update({"reward_first10": float(np.mean(scores[:k])), "reward_last10": float(np.mean(scores[-k:]))})
        if val:
            out.update({"val_before": val[0][1], "val_after": val[-1][1]})
        if write and plot:
            out["reward_curve"] = plot_reward_curve(train, val, os.path.join(output_dir, "reward_curve.png"))
    if write:
        with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return out


def plot_reward_curve(train: list[dict], val: list[tuple], path: str) -> Optional[str]:
    """Train score per step and greedy validation reward, as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no reward_curve.png")
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in train], [h["critic/score/mean"] for h in train], label="train score (mean)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation (greedy)")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
