"""The end-of-run report: reward of the first vs last 10% of the run's steps (from ``metrics.jsonl``, across
resumes), validation, this session's throughput, the reward curve."""
from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Optional

import numpy as np

log = logging.getLogger(__name__)

# the mean reward of a step's rollouts; "critic/score/mean" is its name in runs logged before the rename, so
# a run resumed across the rename still reports every step
SCORE_KEYS = ("rollout/score/mean", "critic/score/mean")
VAL_SCORE = "val/score/mean"


def score_of(row: dict) -> Optional[float]:
    """The step's mean train score, or None when the row is not a training step."""
    for key in SCORE_KEYS:
        if key in row:
            return float(row[key])
    return None


def read_metrics_file(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file; a last line cut short by a crash is skipped."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1 and any(rest.strip() for rest in lines[i + 1:]):
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
            log.warning("%s: the last line is incomplete (the run was killed while writing it); skipped", path)
    return rows


def by_step(rows: Iterable[dict]) -> list[dict]:
    """One row per step in step order, later values winning (a step trained again after a resume replaces it)."""
    merged: dict[int, dict] = {}
    for row in rows:
        if "step" not in row:
            raise ValueError(f"a metrics row has no 'step': {sorted(row)[:8]}")
        merged.setdefault(int(row["step"]), {}).update(row)
    return [merged[s] for s in sorted(merged)]


def run_history(history: list[dict], output_dir: str) -> tuple[list[dict], Optional[str]]:
    """The whole run's rows: ``<output_dir>/metrics.jsonl`` when it exists, else ``history``; and the file."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(path):
        return by_step(read_metrics_file(path)), path
    return by_step(history), None


def summarize(history: list[dict], steps: int, elapsed: float, tokens: float, output_dir: str,
              export_dir: Optional[str], plot: bool, write: bool, resumed_from: Optional[int] = None) -> dict:
    """The summary dict (also ``summary.json`` when ``write``); ``history`` only counts without a metrics.jsonl."""
    rows, source = run_history(history, output_dir)
    train = [h for h in rows if score_of(h) is not None]
    val = [(h["step"], h[VAL_SCORE]) for h in rows if VAL_SCORE in h]
    out = {"steps": steps, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
           # the steps this session trained: None when not known, [] when the checkpoint was already final
           "session_steps": None if resumed_from is None else ([int(resumed_from) + 1, steps] if resumed_from < steps
                                                               else []),
           "resumed_from": resumed_from,
           "metrics_file": source, "export_dir": export_dir, "output_dir": output_dir}
    if train:
        k = max(1, len(train) // 10)
        scores = [score_of(h) for h in train]
        out.update({"train_steps": [train[0]["step"], train[-1]["step"]], "train_rows": len(train),
                    "reward_first10": float(np.mean(scores[:k])),
                    "reward_first10_steps": [train[0]["step"], train[k - 1]["step"]],
                    "reward_last10": float(np.mean(scores[-k:])),
                    "reward_last10_steps": [train[-k]["step"], train[-1]["step"]]})
    if val:
        out.update({"val_before": val[0][1], "val_before_step": val[0][0],
                    "val_after": val[-1][1], "val_after_step": val[-1][0]})
    if train and write and plot:
        out["reward_curve"] = plot_reward_curve(train, val, os.path.join(output_dir, "reward_curve.png"))
    if write:
        with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return out


def _steps(span) -> str:
    lo, hi = span
    return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"


def format_summary(s: dict) -> str:
    """The summary as the lines printed at the end of a run; every figure says which steps it covers."""
    session = "this session"
    resumed = f", resumed from step {s['resumed_from']}" if s.get("resumed_from") else ""
    if s.get("session_steps"):
        session += f" ({_steps(s['session_steps'])}{resumed})"
    elif s.get("session_steps") == []:
        session += f" (no step left to train{resumed})"
    lines = ["", "=== verl_ds summary ===",
             f"steps: {s['steps']}   {session}: {s['elapsed_s']:.1f} s, {s['tokens_per_s']:.0f} tokens/s"]
    if "reward_first10" in s:
        first, last = s["reward_first10_steps"], s["reward_last10_steps"]
        lines.append(f"train reward: {_steps(first)} (first 10% of {s['train_rows']} steps) {s['reward_first10']:.3f}"
                     f" -> {_steps(last)} (last 10%) {s['reward_last10']:.3f} "
                     f"({s['reward_last10'] - s['reward_first10']:+.3f})")
    if "val_before" in s:
        lines.append(f"validation reward (greedy): step {s['val_before_step']} {s['val_before']:.3f} -> "
                     f"step {s['val_after_step']} {s['val_after']:.3f}")
    lines.append(f"run directory: {s['output_dir']}")
    if s.get("reward_curve"):
        lines.append(f"reward curve: {s['reward_curve']}")
    if s.get("export_dir"):
        lines.append(f"HF export: {s['export_dir']}")
    return "\n".join(lines)


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
    ax.plot([h["step"] for h in train], [score_of(h) for h in train], label="train score (mean)")
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
