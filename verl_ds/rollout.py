"""One rollout: prompts -> the actor's ``get_action`` -> a RolloutBatch -> decoded responses -> scores.

``rollout_and_score`` serves training (sampled, ``n`` samples per prompt) and evaluation (greedy, or sampled
for mean@k / pass@k) alike. The actor and the reward are taken from the ModelRegistry by the caller at every
step, so a swapped model is used at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from verl_ds.batch import RolloutBatch
from verl_ds.metrics import Timings


@dataclass
class Rollout:
    """What one rollout produced: the batch (scores set), the decoded responses and the reward metrics."""
    batch: RolloutBatch
    responses: list[str]
    metrics: dict = field(default_factory=dict)


class SamplingError(RuntimeError):
    """Sampling failed (typically non-finite logits: ``torch.multinomial`` refuses NaN/Inf probabilities)."""


def repeat_prompts(prompts: dict, n: int) -> dict:
    """Each prompt ``n`` times in a row (the n samples of a prompt stay together, on one rank), with
    ``group_index`` (B*n,) numbering the prompts 0..B-1."""
    B = prompts["input_ids"].shape[0]
    group = torch.arange(B).repeat_interleave(n)
    out = {k: v.repeat_interleave(n, dim=0) for k, v in prompts.items() if isinstance(v, torch.Tensor)}
    out["prompts"] = [p for p in prompts["prompts"] for _ in range(n)]
    out["extras"] = {k: [x for x in v for _ in range(n)] for k, v in prompts["extras"].items()}
    out["group_index"] = group
    return out


def rollout_and_score(actor, reward, tokenizer, prompts: dict, *, max_new_tokens: int, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0, greedy: bool = False, n: int = 1,
                      timings: Optional[Timings] = None) -> Rollout:
    """Sample ``n`` responses per prompt with ``actor.get_action``, build the batch, decode, score with ``reward``.

    prompts: ``verl_ds.data.collate_prompts`` output on the engines' device (left-padded). The batch carries
    ``rollout_log_probs`` (what the sampler reported), ``group_index`` and ``scores``; ``extras`` holds the
    prompt texts and the data set's pass-through fields. Timings ``gen`` and ``reward`` are recorded.
    """
    t = timings or Timings()
    if n > 1:
        prompts = repeat_prompts(prompts, n)
    group_index = prompts.get("group_index", torch.arange(prompts["input_ids"].shape[0]))
    with t("gen"):
        try:
            action, log_probs, _ = actor.get_action(prompts["input_ids"], prompts["attention_mask"],
                                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                                    max_new_tokens=max_new_tokens, greedy=greedy)
        except RuntimeError as exc:
            if "probability tensor" not in str(exc) and "nan" not in str(exc).lower():
                raise
            raise SamplingError(f"sampling failed: {str(exc).splitlines()[0]}") from exc
        batch = RolloutBatch.from_generation(prompts["input_ids"], prompts["attention_mask"], action,
                                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                             extras={"prompt": prompts["prompts"], **prompts["extras"]})
        batch.rollout_log_probs = log_probs.float()
        batch.group_index = group_index.to(device=action.device, dtype=torch.int64)
    with t("reward"):
        responses = tokenizer.batch_decode(
            [r[:k] for r, k in zip(batch.action.tolist(), batch.response_length.tolist())], skip_special_tokens=True)
        scores, metrics = reward.compute_rewards(batch, prompts["prompts"], responses)
        batch.scores = scores
    return Rollout(batch=batch, responses=responses, metrics=metrics)
