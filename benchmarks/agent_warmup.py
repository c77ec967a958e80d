"""What the agent cold start (verl_ds.sft_loss.warm_up on verl_ds.agent.warmup.demonstrations) leaves a tiny
from-scratch model able to do.

Builds the tiny Llama of a config (``--config``, default configs/agent_calc.yaml when present, with ``-o key=value``
overrides), warms it up as plain torch (AdamW with the config's actor.lr, grad_clip and weight decay, no DeepSpeed),
then runs sampled episodes of the built-in task with verl_ds.agent.episodes.run_episodes and prints the tool-call
rate, the share of calls that are well formed, copy the question's expression, and whose episode then answers
with the tool's result, and the score::

    python benchmarks/agent_warmup.py --env calc --steps 300 -o model.config_overrides.hidden_size=96
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.agent.chat_tokens import ChatTokens  # noqa: E402
from verl_ds.agent.episodes import EpisodeLimits, engine_turns, run_episodes  # noqa: E402
from verl_ds.agent.registry import make_environment  # noqa: E402
from verl_ds.agent.tiny import build_agent_tokenizer, builtin_rows  # noqa: E402
from verl_ds.agent.tools import parse_tool_calls  # noqa: E402
from verl_ds.agent.warmup import WARMUP_LR, demonstrations  # noqa: E402
from verl_ds.config import tiny_model_fields  # noqa: E402
from verl_ds.sft_loss import warm_up  # noqa: E402


class PlainEngine(torch.nn.Module):
    """The engine contract warm_up needs (forward, backward, step, device) over a plain model and AdamW."""

    def __init__(self, model, lr: float, weight_decay: float, grad_clip: float):
        super().__init__()
        self.model, self.grad_clip = model, grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def forward(self, **kw):
        return self.model(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def tiny_model(cfg, tok):
    from transformers import AutoModelForCausalLM

    from verl_ds.engines.build import _tiny_lm_config, init_tiny_weights

    config = _tiny_lm_config(cfg, tok)
    model = AutoModelForCausalLM.from_config(config)
    init_tiny_weights(model, cfg.model.init_seed, config.initializer_range)
    return model


def turns_of(tok, traj) -> list[str]:
    """The model turns' texts of a trajectory (runs of model_mask 1, stop token dropped)."""
    out, cur = [], []
    for i, m in zip(traj.ids, traj.model_mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur[:-1] if cur[-1] == tok.eos_token_id else cur)); cur = []
    if cur:
        out.append(tok.decode(cur[:-1] if cur[-1] == tok.eos_token_id else cur))
    return out


def forcing(generate, first_id: int, first_prompts: set):
    """``generate`` with each episode's first turn started by ``first_id`` (a forced tool call): the skill of
    calling, whatever the rate."""
    def gen(prompts, max_new):
        first = [tuple(p) in first_prompts for p in prompts]
        prompts = [p + [first_id] if f else p for p, f in zip(prompts, first)]
        out = generate(prompts, max_new)
        return [([first_id] + ids[:max_new - 1], [0.0] + lps[:max_new - 1]) if f else (ids, lps)
                for (ids, lps), f in zip(out, first)]
    return gen


def evaluate(model, tok, env_name, n, seed, limits, temperature=1.0, greedy=False, force_call=False):
    from verl_ds.generation import HFRolloutEngine

    model.eval()
    engine = HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             gather_params=False, share_prefill=False)
    tools = make_environment(env_name).tools
    chat = ChatTokens(tok, tools.schemas if tools else None)
    rows = builtin_rows(env_name, n, seed)
    envs = [make_environment(env_name) for _ in rows]
    generate = engine_turns(engine, tok.pad_token_id, temperature=temperature, greedy=greedy)
    if force_call:
        firsts = {tuple(chat.prompt(make_environment(env_name).reset(r))) for r in rows}
        generate = forcing(generate, tok.convert_tokens_to_ids("<tool_call>"), firsts)
    trajs = run_episodes(generate, chat, envs, rows, limits)
    called = well = copied = used = 0
    for t, row in zip(trajs, rows):
        turns = turns_of(tok, t)
        first = parse_tool_calls(turns[0]) if turns else None
        if first is not None and (first.calls or first.errors):
            called += 1
            if first.calls and not first.errors:
                well += 1
                copied += first.calls[0].arguments.get("expression") == row.get("expression")
                used += len(turns) > 1 and turns[1].strip() == row.get("answer")
    score = sum(t.reward for t in trajs) / len(trajs)
    ends = {}
    for t in trajs:
        ends[t.end] = ends.get(t.end, 0) + 1
    return {"tool_call_rate": called / n, "well_formed": well / max(called, 1), "copied_expression": copied / max(called, 1),
            "copied_result": used / max(called, 1), "score": score,
            "turns": sum(t.turns for t in trajs) / n, "ends": ends}, trajs


def main(argv=None):
    from verl_ds.config.loader import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--env", default="calc", choices=["calc", "guess_number"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="the warm-up's; default: verl_ds.agent.warmup.WARMUP_LR")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-turn-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=4, help="print this many episodes")
    ap.add_argument("--model-dir", default=None, help="evaluate this HF model (a run's hf_actor) instead of warming up")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config, args.override)
    tok = build_agent_tokenizer()
    if args.model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    else:
        model = tiny_model(cfg, tok)
        engine = PlainEngine(model, cfg.actor.lr, 0.01, cfg.actor.grad_clip)  # as build_engines' warm-up engine
        n_params = sum(p.numel() for p in model.parameters())
        start = time.time()
        demos = demonstrations(args.env, tok, args.steps * args.batch_size, seed=args.seed)
        losses = warm_up(engine, demos, tok.pad_token_id, batch_size=args.batch_size, lr=args.lr or WARMUP_LR)
        warm_s = time.time() - start
        k = max(1, len(losses) // 10)
        print(f"warmup env={args.env} params={n_params} steps={args.steps} loss_first={sum(losses[:k]) / k:.3f} "
              f"loss_last={sum(losses[-k:]) / k:.3f} seconds={warm_s:.1f}")
    limits = EpisodeLimits(max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                           max_context_tokens=tiny_model_fields(cfg)["max_position_embeddings"])
    start = time.time()
    stats, trajs = evaluate(model, tok, args.env, args.episodes, 10_000 + args.seed, limits)
    print(f"sampled episodes={args.episodes} " + " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
        + f" seconds={time.time() - start:.1f}")
    if args.env == "calc":
        forced, _ = evaluate(model, tok, args.env, args.episodes, 20_000 + args.seed, limits, force_call=True)
        print("forced calls " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in forced.items()))
    for t in trajs[:args.show]:
        print("  |", tok.decode(t.ids).replace("\n", " "), "| reward", t.reward, t.end)
    called = [t for t in trajs if t.tool_calls][:args.show]
    for t in called:
        print("  call |", tok.decode(t.ids).replace("\n", " "), "| reward", t.reward, t.end)


if __name__ == "__main__":
    main()
