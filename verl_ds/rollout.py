"""One rollout: prompts -> the actor's ``get_action`` -> a RolloutBatch -> decoded responses -> scores."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from verl_ds import dist as vdist
from verl_ds.batch import RolloutBatch
from verl_ds.batch_layout import FLOAT_FIELDS
from verl_ds.metrics import Timings


@dataclass
class Rollout:
    """The batch (scores set), decoded responses and reward metrics; ``per_sample``: each mean metric's (B,) values,
    so a selection of rows (an async step's groups from several calls) gets its own means."""
    batch: RolloutBatch
    responses: list[str]
    metrics: dict = field(default_factory=dict)
    per_sample: dict = field(default_factory=dict)


def sample_means(per_sample: dict) -> dict:
    """The metrics of ``Rollout.per_sample`` values: each one's mean over the samples."""
    return {k: v.float().mean() for k, v in per_sample.items()}


_PART = "per_sample:"  # ``collect``'s extras key prefix of a per-sample metric's values


class SamplingError(RuntimeError):
    """Sampling failed (typically non-finite logits: ``torch.multinomial`` refuses NaN/Inf probabilities)."""


def repeat_prompts(prompts: dict, n: int) -> dict:
    """Each prompt ``n`` times in a row (its samples stay on one rank), with ``group_index`` (B*n,)."""
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
    """Sample ``n`` responses per prompt, build the batch, decode and score with ``reward``."""
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
        parts: dict = {}
        batch.scores, _ = reward.compute_rewards(batch, prompts["prompts"], responses, per_sample=parts)
    return Rollout(batch=batch, responses=responses, metrics=sample_means(parts), per_sample=parts)


def _pad_to(batch: RolloutBatch, prompt_width: int, response_width: int, pad_token_id: int) -> RolloutBatch:
    """The batch padded to ``prompt_width`` + ``response_width`` columns, so that rounds of different widths join."""
    B, left, right = len(batch), prompt_width - batch.prompt_width, response_width - batch.response_width
    for name, fill in (("observation", pad_token_id), ("next_observation", pad_token_id), ("mask", False)):
        t = batch[name]
        batch[name] = torch.cat([t.new_full((B, max(left, 0)), fill), t, t.new_full((B, max(right, 0)), fill)], dim=1)
    if right > 0:
        for name in ("action", "response_mask") + FLOAT_FIELDS:
            t = batch[name]
            if t is not None:
                fill = pad_token_id if name == "action" else 0
                batch[name] = torch.cat([t, t.new_full((B, right), fill)], dim=1)
    return batch


def _add_overlong_penalty(batch: RolloutBatch, max_new_tokens: int, overlong: tuple) -> torch.Tensor:
    """Add DAPO's overlong penalty to each response's score at its last token; returns the (B,) penalties."""
    from verl_ds import algos

    penalty = algos.overlong_reward_penalty(batch.response_length, max_new_tokens, *overlong)
    batch.scores[torch.arange(len(batch)), batch.response_length - 1] += penalty.to(batch.scores)
    return penalty


def collect(draw_prompts, actor, reward, tokenizer, *, sampling: dict, n: int, timings: Timings,
            dynamic: bool = False, max_rounds: int = 1, overlong: Optional[tuple] = None,
            greedy_baseline: bool = False, rollout_fn=rollout_and_score) -> Rollout:
    """This rank's rollout for one step from rounds of ``draw_prompts()``, each sampled and scored by ``rollout_fn``.
    ``overlong``: DAPO's soft overlong penalty (Yu et al. 2025, eq. 13); ``greedy_baseline``: ReMax (Li et al. 2023);
    ``dynamic``: DAPO's dynamic sampling, judged before the overlong penalty (a length penalty says nothing about
    the answer), rounds agreed over ranks, a rank still short filled with no-signal groups (rollout/groups_filled)."""
    from verl_ds import algos

    kept, dropped, metrics, rounds, target = [], [], {}, 0, None
    shaping = overlong is not None and overlong[0] > 0
    while True:
        prompts = draw_prompts()
        target = target or prompts["input_ids"].shape[0]
        ro = rollout_fn(actor, reward, tokenizer, prompts, n=n, timings=timings, **sampling)
        b = ro.batch
        b.group_index = b.group_index + rounds * target  # unique over the rounds of this step
        verified = b.scores.sum(-1)  # the reward's own score, before shaping: what dynamic sampling filters on
        parts = dict(ro.per_sample)
        if shaping:
            parts["reward/overlong_penalty/mean"] = _add_overlong_penalty(b, sampling["max_new_tokens"], overlong)
        for k, v in parts.items():  # each sample's values ride with its row through the rounds' selection below
            b.extras[_PART + k] = v.tolist()
        if greedy_baseline:
            with timings("gen_baseline"):
                base = rollout_fn(actor, reward, tokenizer, prompts, greedy=True,
                                  max_new_tokens=sampling["max_new_tokens"])
            if shaping:  # the baseline is scored like the samples it is subtracted from
                _add_overlong_penalty(base.batch, sampling["max_new_tokens"], overlong)
            b.extras["baseline_score"] = base.batch.scores.sum(-1).repeat_interleave(n).tolist()
        b.extras["response_text"] = ro.responses
        metrics.update(ro.metrics)
        rounds += 1
        if not dynamic:
            kept.append(b)
            break
        signal = algos.groups_with_signal(verified, b.group_index)
        kept.append(b.select(signal.nonzero().flatten()))
        dropped.append(b.select((~signal).nonzero().flatten()))
        have = sum(len(k) for k in kept) // n
        if not vdist.any_rank(have < target) or rounds >= max_rounds:
            break
    width = max(b.prompt_width for b in kept + dropped)
    response_width = max(b.response_width for b in kept + dropped)
    pad = tokenizer.pad_token_id
    join = lambda parts: RolloutBatch.cat([_pad_to(p, width, response_width, pad) for p in parts])  # noqa: E731
    batch = join([k for k in kept if len(k)] or kept[:1])
    if dynamic:
        filled = max(0, target - len(batch) // n)
        if filled:  # short after the last round: top up with groups that carry no signal
            batch = join([p for p in (batch, join([d for d in dropped if len(d)]).select(slice(0, filled * n)))
                          if len(p)])
        batch = batch.select(slice(0, target * n))
        metrics.update({"rollout/sampling_rounds": torch.tensor(float(rounds)),
                        "rollout/groups_dropped": torch.tensor(float(sum(len(d) for d in dropped) // n)),
                        "rollout/groups_filled": torch.tensor(float(filled))})
    responses = list(batch.extras.pop("response_text"))
    # the reward metrics of the rows trained (dynamic sampling keeps rows of several rounds, not the last round's)
    parts = {k[len(_PART):]: torch.tensor(batch.extras.pop(k), device=batch.scores.device)
             for k in [k for k in batch.extras if k.startswith(_PART)]}
    metrics.update(sample_means(parts))
    return Rollout(batch=batch, responses=responses, metrics=metrics, per_sample=parts)


def sampler_mismatch(batch) -> dict:
    """|sampler - trainer log-prob| over the response tokens (mean; max over all ranks'), {} without that pass."""
    if batch.old_log_probs is None:
        return {}
    rm = batch.response_mask
    diff = (batch.rollout_log_probs - batch.old_log_probs).abs() * rm  # vLLM, bf16, KV-cache numerics
    top = diff.max().to(vdist.comm_device(), torch.float64)
    if vdist.world_size() > 1:  # the largest over every rank's tokens, not a mean of per-rank maxima
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
    return {"rollout/log_prob_diff_mean": diff.sum() / rm.sum(), "rollout/log_prob_diff_max": top}
