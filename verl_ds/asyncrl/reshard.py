"""An asynchronous rollout's checkpoint resumed at another world size (docs/async.md). Each saved rank's pipeline
(queued groups, prompts in flight, prompts to redo, then its sampler slices) is laid end to end step by step, rank
by rank: the global sequence the saved run would have trained next. The new ranks take it as the sampler deals a
global batch, so the next global batches are made of the same prompts."""
from __future__ import annotations

from verl_ds.sampler import DistributedPromptSampler


def _at(sampler: DistributedPromptSampler) -> int:
    """Global batches drawn since the start (every epoch has ``batches_per_epoch``)."""
    return sampler.epoch * sampler.batches_per_epoch + sampler.position


def _interleave(pipes: list, per_rank: int) -> list:
    """The pipelines' items step by step (``per_rank`` from each rank, rank by rank)."""
    steps = -(-max(len(p) for p in pipes) // per_rank)
    return [x for j in range(steps) for p in pipes for x in p[j * per_rank:(j + 1) * per_rank]]


def reshard(ranks: list, world: int, drop_last: bool = True) -> tuple[list, list]:
    """Deal the saved ranks' states (``AsyncRollout.state_dict()["ranks"]``) to ``world`` ranks. Returns (one
    {"queue", "redo", "sampler"} per new rank: the groups to queue now, then prompts and groups in order, and the
    sampler state to continue from; notes to log)."""
    old = len(ranks)
    first = ranks[0]["sampler"]
    size, total = int(first["global_batch_size"]), int(first["dataset_len"])
    if size % world:
        raise ValueError(f"resume: the asynchronous rollout state holds global batches of {size} prompts, which "
                         f"{world} ranks cannot split evenly (rollout.batch_size must stay {size})")
    per_old, per_new = size // old, size // world
    samplers, pipes = [], []
    for r, st in enumerate(ranks):
        sampler = DistributedPromptSampler(total, per_old, r, old, seed=int(st["sampler"]["seed"]), drop_last=drop_last)
        sampler.load_state_dict(st["sampler"])
        samplers.append(sampler)
        pipes.append(list(st["queue"]) + [int(i) for i, _ in st["inflight"]] + list(st["redo"]))
    # every saved rank up to the furthest sampler: the global batches some rank drew early, the others' slices too
    top = max(_at(s) for s in samplers)
    for s, p in zip(samplers, pipes):
        while _at(s) < top:
            p.extend(s.next_batch())
    notes = []
    steps = -(-max(len(p) for p in pipes) // per_old)
    for s, p in zip(samplers, pipes):  # a rank that dropped stale groups fills its steps from its next batches
        while len(p) < steps * per_old:
            p.extend(s.next_batch())
    sequence = _interleave([p[:steps * per_old] for p in pipes], per_old)
    rest = [p[steps * per_old:] for p in pipes]
    top = max(_at(s) for s in samplers)
    for s, p in zip(samplers, rest):  # filling may have taken some ranks a batch further than others
        while _at(s) < top:
            p.extend(s.next_batch())
    if any(rest):  # the saved ranks were offset by the groups they dropped: no step boundary in common
        sequence += _interleave(rest, per_old)
        notes.append(f"the {old} saved ranks had dropped stale groups in unequal numbers (their pipelines were "
                     f"{[len(p) for p in rest]} prompts past step {steps} of the saved queue): the first {steps} "
                     f"step(s) keep the saved run's prompts; after them the prompts left over from the saved ranks' "
                     f"sampler slices come first, then global batch {top}")
    out = [{"queue": [], "redo": [], "sampler": samplers[0].state_dict()} for _ in range(world)]
    for start in range(0, len(sequence), size):
        for r in range(world):
            out[r]["redo"].extend(sequence[start + r * per_new:start + (r + 1) * per_new])
    for part in out:  # the groups before the first prompt go to the queue at once; the rest in their turn
        lead = next((k for k, x in enumerate(part["redo"]) if not isinstance(x, dict)), len(part["redo"]))
        part["queue"], part["redo"] = part["redo"][:lead], part["redo"][lead:]
    groups = sum(isinstance(x, dict) for x in sequence)
    notes.insert(0, f"the asynchronous rollout state of {old} rank(s) dealt to {world}: {groups} queued group(s) "
                    f"kept with their samples, {len(sequence) - groups} prompt(s) to generate, then global batch "
                    f"{top} of the sampler")
    return out, notes


def rank_part(state: dict, world: int, rank: int, drop_last: bool = True) -> tuple[dict, list]:
    """This rank's part of an asynchronous rollout checkpoint (colocated or split): at the saved world size its own
    state (and ``rng``), prompts in flight at the head of ``redo``; else its share through ``reshard``. Plus notes."""
    ranks = state["ranks"]
    if len(ranks) != world:
        parts, notes = reshard(ranks, world, drop_last=drop_last)
        return parts[rank], notes
    mine = ranks[rank]
    return {**mine, "inflight": [], "redo": [int(i) for i, _ in mine["inflight"]] + list(mine["redo"])}, []
