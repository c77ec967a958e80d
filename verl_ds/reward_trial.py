"""A reward's trial before it replaces the active one, so one that cannot score this run fails at the step boundary
(where ``verl_ds.step_boundary`` rolls it back) instead of failing the next step."""
from __future__ import annotations

import torch

from verl_ds.rewards import REWARD_FNS, rows_failing

TEST_ROWS = 4  # prompts in the test call's batch


def check_rows(functions: list, datasets, who: str = "reward swap") -> None:
    """ValueError naming the first row a function cannot score: a mid-run reward cannot skip rows as start-up does."""
    for ds in datasets:
        if ds is None or not functions:
            continue
        bad = rows_failing(ds, functions)
        if bad:
            first = min(bad)
            raise ValueError(f"{who}: {len(bad)} of {len(ds)} rows of {ds.source} cannot be scored (row {first}: "
                             f"{bad[first]}); this data set was checked against the configured reward only")


def check_swap_rows(request: dict, datasets, mode: str = "sync") -> dict:
    """``check_rows`` for a validated swap's shipped functions (no user code runs); returns the request."""
    if mode != "sync" and request.get("model_path") is not None:
        raise ValueError(f"reward swap: model_path is refused with rollout.mode={mode}: a reward model's forward is a "
                         "collective, and this run scores in its generation thread or on its generation ranks, "
                         "outside the training ranks' collectives; swap in reward functions, or train with "
                         "rollout.mode=sync")
    shipped = [(f["name"], REWARD_FNS[f["name"]]) for f in request["functions"]
               if f["name"] in REWARD_FNS and not f["per_token"]]
    check_rows(shipped, datasets)
    return request


@torch.no_grad()
def trial(reward, tokenizer, datasets, device) -> None:
    """The row check for a built RewardModel's own functions, then one call on TEST_ROWS prompts: finite scores."""
    from verl_ds.batch import RolloutBatch
    from verl_ds.data import collate_prompts

    check_rows([(n, fn) for n, fn, per_token in reward.functions() if n not in REWARD_FNS and not per_token],
               datasets, who="reward")
    ds = next(d for d in datasets if d is not None)
    items = [ds[i] for i in range(min(TEST_ROWS, len(ds)))]
    prompts = collate_prompts(items, tokenizer.pad_token_id)
    B, eos = len(items), tokenizer.eos_token_id
    response = prompts["input_ids"][:, -1:]  # left-padded: a real token of every row
    if eos is not None:
        response = torch.cat([response, torch.full((B, 1), eos, dtype=torch.int64)], dim=1)
    length = torch.full((B,), response.shape[1], dtype=torch.int64)
    batch = RolloutBatch.from_generation(prompts["input_ids"].to(device), prompts["attention_mask"].to(device),
                                         response.to(device), length.to(device),
                                         torch.full((B,), eos is not None, device=device),
                                         pad_token_id=tokenizer.pad_token_id,
                                         extras={"prompt": prompts["prompts"], **prompts["extras"]})
    texts = tokenizer.batch_decode(response.tolist(), skip_special_tokens=True)
    scores, _ = reward.compute_rewards(batch, prompts["prompts"], texts)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"reward: the test call on {B} of this run's prompts gave non-finite scores "
                         f"({scores.sum(-1).tolist()}); the weights or the scores overflow float32")
