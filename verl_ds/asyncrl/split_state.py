"""Checkpoints of streaming on split ranks: the generation ranks' queues travel into the training ranks' checkpoint in
the colocated ``AsyncRollout.state_dict`` format, so ``reshard`` deals them at another world size and colocated and
split checkpoints resume on each other (docs/async.md). RNG streams follow ``verl_ds.checkpoint``'s rule: rank r
takes saved rank r's stream, else the training rank's own as restored (the stream a synchronous run continues)."""
from __future__ import annotations

import logging

import torch

from verl_ds import dist as vdist
from verl_ds.asyncrl.bridge import _SAVE, _control, _recv_obj, _send_obj
from verl_ds.asyncrl.reshard import rank_part

log = logging.getLogger(__name__)


def rng_now(device) -> dict:
    """The torch RNG state a generation on ``device`` draws from (CPU, and the CUDA device's when on one)."""
    out = {"torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def rng_set(state: dict, device) -> None:
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if "cuda" in state and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu(), device)


def _empty(sampler) -> dict:
    return {"queue": [], "inflight": [], "redo": [], "sampler": sampler.state_dict()}


# ---------------------------------------------------------------------- the training ranks' side (RemoteRollout)

def gather_states(placement, src: int, mode: str, sampler, restored, started: bool, broken: bool) -> dict:
    """Every training rank's queue state from the generation ranks (a collective of every rank of the job):
    ``src`` is this rank's generation rank, ``restored`` the part a resume kept for it (``restore_part``)."""
    if mode != "streaming" or not started:
        # one_step_off: the batch made ahead is made again from the trainer's data position; not started yet (a
        # failure right after a resume): the restored part, unchanged
        mine = restored or _empty(sampler)
        mine = {"inflight": [], **mine}
    elif vdist.any_rank(broken):  # a generation rank failed: the bridge is gone
        log.warning("checkpoint: the generation ranks' queues cannot be saved (a generation rank failed): the resume "
                    "generates again from the trainers' data position (prompts handed back for regeneration are lost)")
        mine = _empty(sampler)
    else:
        _control(placement.bridge, _SAVE)
        mine = _recv_obj(placement.bridge, src)
    return {"mode": mode, "world_size": vdist.world_size(), "placement": "split", "ranks": vdist.gather_object(mine)}


def restore_part(state: dict, rollout_cfg, sampler, device):
    """This training rank's part of ``state`` for its generation rank at the start; None with nothing to restore
    (``rollout_cfg``: the config's rollout section, ``device``: where a fresh RNG stream is read)."""
    if "ranks" not in state:
        log.warning("resume: the checkpoint holds no rollout queues (%s); generating from the data position",
                    state.get("mode"))
        return None
    mine, notes = rank_part(state, vdist.world_size(), vdist.rank(), drop_last=sampler.drop_last)
    for k, line in enumerate(notes if vdist.rank() == 0 else ()):
        (log.info if k == 0 else log.warning)("resume: %s", line)
    if rollout_cfg.mode != "streaming":
        held = len(mine["queue"]) + len(mine["redo"])
        if vdist.any_rank(held > 0):
            from verl_ds.checkpoint import CheckpointError

            raise CheckpointError(f"resume: the checkpoint holds queued groups or prompts in flight (saved with "
                             f"rollout.mode={state.get('mode')}), which rollout.mode={rollout_cfg.mode} with "
                             f"rollout.split_ranks={rollout_cfg.split_ranks} cannot restore: resume with "
                             f"rollout.mode=streaming, or without rollout.split_ranks")
        return None  # the generation ranks start from the trainers' data position
    if "rng" not in mine:  # as verl_ds.checkpoint restores RNGs: saved rank r's stream, else this rank's own
        saved = state["ranks"][vdist.rank()].get("rng") if vdist.rank() < len(state["ranks"]) else None
        mine = {**mine, "rng": saved if saved is not None else rng_now(device)}
    return mine


def send_part(placement, src: int, part) -> None:
    """At the start of streaming (after the first weights): this rank's restored part, or None, to generation rank
    ``src``."""
    _send_obj(placement.bridge, part, src)


# ---------------------------------------------------------------------- the generation rank's side (split_stream)

def receive_parts(placement, served: list) -> dict:
    """Each served training rank's restored part (None: a fresh start), in the order they are sent."""
    return {t: _recv_obj(placement.bridge, t) for t in served}


def save(streamer) -> None:
    """``_SAVE`` on a generation rank: snapshot every served rank at a decoding step, send each its state."""
    states = {}
    streamer.gate.poke(lambda: states.update({t: lane.snapshot() for t, lane in streamer.lanes.items()}))
    for t in streamer.g.served:
        _send_obj(streamer.pl.bridge, states[t], t)
