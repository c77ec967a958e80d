"""The SFT job's loss, -log p of the trained response tokens (docs/stages.md), and the RL job's warm-up
(``actor.sft_warmup_steps``) that trains it; below the jobs, so construction can warm an actor up."""
from __future__ import annotations

import torch

WARMUP_BATCH = 16  # demonstrations per warm-up step


def collate(items: list, pad_token_id: int, device=None) -> tuple:
    """(observation (B, P+R), mask (B, P+R) bool, loss_mask (B, R) float): prompts left-padded to P, responses
    right-padded to R, as an RL rollout batch."""
    P = max(len(x["prompt_ids"]) for x in items)
    R = max(len(x["response_ids"]) for x in items)
    obs = torch.full((len(items), P + R), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(items), P + R), dtype=torch.bool)
    loss_mask = torch.zeros((len(items), R), dtype=torch.float32)
    for i, x in enumerate(items):
        p, r = len(x["prompt_ids"]), len(x["response_ids"])
        obs[i, P - p:P] = torch.as_tensor(x["prompt_ids"])
        obs[i, P:P + r] = torch.as_tensor(x["response_ids"])
        mask[i, P - p:P + r] = True
        loss_mask[i, :r] = torch.as_tensor(x["loss_mask"], dtype=torch.float32)
    return obs.to(device), mask.to(device), loss_mask.to(device)


def response_nll(model, items: list, pad_token_id: int, device=None) -> torch.Tensor:
    """The summed -log p () of the trained tokens of ``items`` under ``model`` (a LogProbRole); the caller divides
    by the trained tokens of the whole step, so micro-batches and ranks add up to one token mean."""
    obs, mask, loss_mask = collate(items, pad_token_id, device)
    return -(model.get_logprob(obs, obs[:, -loss_mask.shape[1]:], mask) * loss_mask).sum()


def warm_up(engine, demonstrations: list, pad_token_id: int, batch_size: int = WARMUP_BATCH,
            lr: float | None = None) -> list[float]:
    """One SFT step of ``engine`` (forward, backward, step) per ``batch_size`` (ids, trained mask) demonstrations,
    in order, at ``lr`` (None: the optimizer's own). Returns each step's loss."""
    from verl_ds.models.policy import ReferenceModel

    for g in engine.optimizer.param_groups:  # a warm-up engine of its own: nothing to restore
        g["lr"] = lr or g["lr"]
    model, losses = ReferenceModel(engine), []
    engine.train()
    for i in range(0, len(demonstrations) - batch_size + 1, batch_size):
        items = [{"prompt_ids": ids[:k], "response_ids": ids[k:], "loss_mask": mask[k:]}  # from the first trained one
                 for ids, mask in demonstrations[i:i + batch_size] for k in [mask.index(1)]]
        loss = response_nll(model, items, pad_token_id, engine.device) / sum(sum(x["loss_mask"]) for x in items)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses
