"""Multi-turn rollouts for the trainer: prompts -> one episode per sample -> a RolloutBatch laid out as single-turn
samples are (prompt left-padded, then everything after it). ``response_mask`` is 1 only on sampled tokens; the
score sits on the model's last token. Layout and ``agent/*`` metrics: docs/agents.md."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.episodes import END_REASONS, EpisodeLimits, Trajectory, engine_turns, run_episodes
from verl_ds.agent.registry import make_environment
from verl_ds.agent.sandbox import call_counts
from verl_ds.batch import RolloutBatch
from verl_ds.metrics import Timings

__all__ = ["AgentSpec", "agent_rollout", "agent_rollout_fn", "trajectories_to_batch"]


class AgentSpec:
    """What the ``agent`` config section says: the environment, its arguments and the episode limits."""

    def __init__(self, environment: str, env_args: Optional[dict] = None, limits: EpisodeLimits = EpisodeLimits(),
                 workers: int = 8):
        self.environment, self.env_args, self.limits, self.workers = environment, dict(env_args or {}), limits, workers

    @classmethod
    def from_config(cls, cfg) -> "AgentSpec":
        a = cfg.agent
        return cls(a.environment, a.env_args, EpisodeLimits(
            max_turns=a.max_turns, max_tool_calls=a.max_tool_calls, max_context_tokens=a.max_context_tokens,
            max_turn_tokens=cfg.rollout.max_new_tokens, step_timeout_s=a.step_timeout_s))

    def chat(self, tokenizer, env) -> ChatTokens:
        """The token pieces under the tokenizer's chat template, with the environment's tools rendered."""
        tools = getattr(env, "tools", None)
        return ChatTokens(tokenizer, tools=tools.schemas if tools is not None else None)


def _samples(prompts: dict) -> list[dict]:
    """The data set rows behind collated prompts: the prompt text and every pass-through field."""
    extras = prompts["extras"]
    return [{"prompt": text, **{k: v[i] for k, v in extras.items()}} for i, text in enumerate(prompts["prompts"])]


def _trimmed(t: Trajectory) -> tuple[list, list, list]:
    """The trajectory's ids, model mask and log-probs up to its last sampled token."""
    last = max((i for i, m in enumerate(t.model_mask) if m), default=-1)
    return t.ids[:last + 1], t.model_mask[:last + 1], t.log_probs[:last + 1]


def trajectories_to_batch(trajs: list[Trajectory], *, pad_token_id: int, eos_token_id: int,
                          device=None) -> tuple[RolloutBatch, int]:
    """The trajectories' RolloutBatch and mismatch count. A trajectory without a sampled token becomes a one-EOS
    row that nothing trains on (score 0), so groups keep their size."""
    rows = []
    for t in trajs:
        ids, model_mask, log_probs = _trimmed(t)
        if not ids or not t.prompt_ids:
            rows.append(([eos_token_id], [eos_token_id], [0], [0.0], 0.0))
        else:
            rows.append((t.prompt_ids, ids, model_mask, log_probs, t.reward))
    B = len(rows)
    P, R = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    observation = torch.full((B, P + R), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((B, P + R), dtype=torch.bool)
    response_mask = torch.zeros((B, R), dtype=torch.bool)
    log_prob = torch.zeros((B, R), dtype=torch.float32)
    scores = torch.zeros((B, R), dtype=torch.float32)
    for i, (prompt, ids, model_mask, lps, reward) in enumerate(rows):
        observation[i, P - len(prompt):P] = torch.tensor(prompt)
        observation[i, P:P + len(ids)] = torch.tensor(ids)
        mask[i, P - len(prompt):P + len(ids)] = True
        response_mask[i, :len(ids)] = torch.tensor(model_mask, dtype=torch.bool)
        log_prob[i, :len(ids)] = torch.tensor(lps, dtype=torch.float32)
        scores[i, len(ids) - 1] = reward
    response_length = torch.tensor([len(r[1]) for r in rows], dtype=torch.int64)
    batch = RolloutBatch(observation=observation, action=observation[:, P:].clone(), mask=mask,
                         response_mask=response_mask, prompt_length=torch.tensor([len(r[0]) for r in rows]),
                         response_length=response_length,
                         done=torch.tensor([t.end == "done" for t in trajs], dtype=torch.bool),
                         next_observation=RolloutBatch.make_next_observation(observation, pad_token_id),
                         rollout_log_probs=log_prob, scores=scores)
    batch = batch.to(device) if device is not None else batch
    return batch, _mismatches(batch, rows)


def _mismatches(batch: RolloutBatch, rows: list) -> int:
    """Sampled tokens whose id or log-prob in ``batch`` is not what the sampler returned."""
    action, lp, rm = batch.action.cpu(), batch.rollout_log_probs.cpu(), batch.response_mask.cpu()
    bad = 0
    for i, (_, ids, model_mask, lps, _) in enumerate(rows):
        want = torch.tensor([x for x, m in zip(ids, model_mask) if m], dtype=torch.int64)
        want_lp = torch.tensor([x for x, m in zip(lps, model_mask) if m], dtype=torch.float32)
        got, got_lp = action[i][rm[i]], lp[i][rm[i]]
        if got.shape != want.shape:
            bad += max(len(want), len(got))
            continue
        bad += int(((got != want) | (got_lp != want_lp)).sum())
    return bad


def episode_metrics(trajs: list[Trajectory], mismatches: int) -> dict:
    """The ``agent/*`` metrics, averaged over trajectories (table: docs/agents.md)."""
    n = max(len(trajs), 1)
    mean = lambda values: torch.tensor(sum(values) / n, dtype=torch.float64)  # noqa: E731
    out = {"agent/turns/mean": mean(t.turns for t in trajs),
           "agent/tool_calls/mean": mean(t.tool_calls for t in trajs),
           "agent/tool_call_rate": mean(t.tool_calls > 0 for t in trajs),
           "agent/tool_errors/mean": mean(t.tool_errors for t in trajs),
           "agent/env_seconds/mean": mean(t.env_seconds for t in trajs),
           "agent/truncated": mean(t.end != "done" for t in trajs),
           "agent/retokenization_mismatches": torch.tensor(float(mismatches), dtype=torch.float64)}
    for reason in END_REASONS[1:]:
        out[f"agent/end/{reason}"] = mean(t.end == reason for t in trajs)
    return out


def agent_rollout(spec: AgentSpec, actor, tokenizer, prompts: dict, *, max_new_tokens: int, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, greedy: bool = False, n: int = 1,
                  timings: Optional[Timings] = None):
    """``n`` episodes per prompt as a ``verl_ds.rollout.Rollout``; timings ``gen`` (episodes, environment steps
    included) and ``reward`` (building the batch)."""
    from verl_ds.rollout import Rollout, repeat_prompts

    t = timings or Timings()
    if n > 1:
        prompts = repeat_prompts(prompts, n)
    samples = _samples(prompts)
    group_index = prompts.get("group_index", torch.arange(len(samples)))
    engine = actor.rollout_engine
    runs_before = call_counts()
    with t("gen"):
        envs = [make_environment(spec.environment, spec.env_args) for _ in samples]
        chat = spec.chat(tokenizer, envs[0])
        generate = engine_turns(engine, tokenizer.pad_token_id, stop_token_ids=chat.stop_ids, temperature=temperature,
                                top_k=top_k, top_p=top_p, greedy=greedy)
        trajs = run_episodes(generate, chat, envs, samples,
                             replace(spec.limits, max_turn_tokens=max_new_tokens), spec.workers)
    with t("reward"):
        batch, mismatches = trajectories_to_batch(trajs, pad_token_id=tokenizer.pad_token_id,
                                                  eos_token_id=tokenizer.eos_token_id, device=engine.device)
        batch.group_index = group_index.to(device=batch.observation.device, dtype=torch.int64)
        batch.extras = {"prompt": list(prompts["prompts"]), **prompts["extras"],
                        "agent_end": [tr.end for tr in trajs]}
        texts = [tokenizer.decode(tr.ids) for tr in trajs]
    metrics = episode_metrics(trajs, mismatches)
    runs = call_counts()
    for backend in ("bwrap", "weak"):  # the isolation model-written code ran under this step
        runs[backend] = runs.get(backend, 0) - runs_before.get(backend, 0)
        metrics[f"agent/sandbox_runs/{backend}"] = torch.tensor(float(runs[backend]), dtype=torch.float64)
    return Rollout(batch=batch, responses=texts, metrics=metrics)


def agent_rollout_fn(spec: AgentSpec):
    """``agent_rollout`` with ``rollout_and_score``'s signature (the environment scores), for ``rollout.collect``."""
    def rollout(actor, reward, tokenizer, prompts, **kwargs):
        return agent_rollout(spec, actor, tokenizer, prompts, **kwargs)
    return rollout
