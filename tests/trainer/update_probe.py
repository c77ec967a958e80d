"""One real update (critic, then actor) of a Trainer on a FIXED global batch, so that runs with other batch shapes,
world sizes or kernels can be compared. Run as a script by test_invariance.py (1 rank, or 2 under torchrun):

    python update_probe.py <result.pt> key.sub=value ...

Every rank takes its contiguous share of the same global batch (fixed prompts, fixed responses, fixed scores).
Rank 0 writes {"metrics": the update's metrics reduced over ranks, "advantages": every rank's advantages in global
row order, "actor": {name: update}, "critic": {...}}, each update the full (gathered) parameter after the step minus
before it.
"""
import sys

import torch


def fixed_batch(trainer, global_size: int = 8, R: int = 6):
    """Rows [rank*n, (rank+1)*n) of a deterministic global batch (the same on any world size)."""
    from verl_ds.batch import RolloutBatch
    from verl_ds.data import collate_prompts

    tok, rank, world = trainer.tokenizer, trainer.rank, trainer.world
    g = torch.Generator().manual_seed(1234)
    digits = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    responses = digits[torch.randint(0, 10, (global_size, R), generator=g)]
    lengths = torch.randint(1, R + 1, (global_size,), generator=g)
    k = trainer.cfg.rollout.n  # the samples of a group answer the same prompt, as in a real rollout
    for i in range(global_size):  # and the j-th sample of a group repeats the first j tokens of its first sample's
        responses[i, :i % k] = responses[i - i % k, :i % k]  # response, as a converging policy's samples do
    ends = lengths < R
    responses[ends, lengths[ends] - 1] = tok.eos_token_id  # some rows end with EOS, the others are truncated
    scores = torch.rand(global_size, generator=g)
    n = global_size // world
    rows = slice(rank * n, (rank + 1) * n)
    prompts = collate_prompts([trainer.c.train_set[i // k] for i in range(global_size)], tok.pad_token_id)
    batch = RolloutBatch.from_generation(prompts["input_ids"][rows], prompts["attention_mask"][rows], responses[rows],
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                         extras={"prompt": prompts["prompts"][rows]})
    batch.scores = torch.zeros(n, R)
    batch.scores[torch.arange(n), batch.response_length - 1] = scores[rows]
    batch.group_index = (torch.arange(n) + rank * n) // trainer.cfg.rollout.n  # whole groups on each rank
    return batch


def multi_turn_batch(trainer, global_size: int = 8):
    """Rows of a deterministic global batch of multi-turn trajectories (``verl_ds.agent.rollout``): model turns
    (digits, most ending with EOS) with environment answers between them (attended, not trained), one to three
    turns per row, one row ending with an environment answer (trimmed), sampler log-probs and a final reward."""
    from verl_ds.agent.episodes import Trajectory
    from verl_ds.agent.rollout import trajectories_to_batch

    tok, rank, world, k = trainer.tokenizer, trainer.rank, trainer.world, trainer.cfg.rollout.n
    g = torch.Generator().manual_seed(4321)
    digits = tok.convert_tokens_to_ids([str(d) for d in range(10)])
    answer = tok.convert_tokens_to_ids(["user", ":", "even"]) + tok.convert_tokens_to_ids(["assistant", ":"])
    trajs = []
    for i in range(global_size):
        t = Trajectory(prompt_ids=list(trainer.c.train_set[i // k]["input_ids"]))
        turns = 1 + int(torch.randint(0, 3, (1,), generator=g))
        for turn in range(turns):
            ids = [digits[j] for j in torch.randint(0, 10, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                    generator=g).tolist()] + [tok.eos_token_id]
            t.append(ids, sampled=True, log_probs=(-torch.rand(len(ids), generator=g)).tolist())
            if turn < turns - 1 or i == 3:
                t.append(answer, sampled=False)
        t.reward = float(torch.rand(1, generator=g))
        t.finish("done")
        trajs.append(t)
    batch, mismatches = trajectories_to_batch(trajs, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert mismatches == 0
    n = global_size // world
    batch = batch.select(slice(rank * n, (rank + 1) * n))
    batch.group_index = (torch.arange(n) + rank * n) // k  # whole groups on each rank
    batch.extras = {"prompt": [trainer.c.train_set[i // k]["prompt"] for i in range(rank * n, (rank + 1) * n)]}
    return batch


def gathered(module) -> dict:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    out = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p], modifier_rank=None):
            out[name] = p.detach().to("cpu", torch.float32, copy=True)
    return out


def main(result_path: str, overrides: list) -> None:
    from verl_ds.config import load_config
    from verl_ds.dist import detect_launch
    from verl_ds.metrics import reduce_metrics
    from verl_ds.packing import micro_batch_groups
    from verl_ds.prompt_sharing import pack_shared_prompts
    from verl_ds import dist as vdist
    from verl_ds.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), detect_launch())
    from verl_ds.models.sequence_parallel import SequenceParallel

    split_rows = []  # (local, padded) tokens of each packed row split over a sequence-parallel group
    shard = SequenceParallel.shard
    SequenceParallel.shard = lambda self, packed: split_rows.append(shard(self, packed)) or split_rows[-1]
    cfg, ppo = trainer.cfg, trainer.ppo
    engines = trainer.c.engines
    before = {role: gathered(engines[role].module) for role in ("actor", "critic") if role in engines}
    import os

    batch = multi_turn_batch(trainer) if os.environ.get("VERL_DS_PROBE_TURNS") else fixed_batch(trainer)
    T = trainer.state.get("temperature")
    pairs = micro_batch_groups(batch, 2, None)
    with torch.no_grad():
        batch.old_log_probs = trainer._no_grad_pass("actor", batch, pairs, lambda m, b: m.get_logprob(
            b.observation, b.action, b.mask, T))
        if ppo.ref is not None:
            batch.ref_log_probs = trainer._no_grad_pass("ref", batch, pairs, lambda m, b: m.get_logprob(
                b.observation, b.action, b.mask, T))
        if ppo.needs_critic:
            batch.values = trainer._no_grad_pass("critic", batch, pairs, lambda m, b: m.get_values(
                b.observation, b.mask, b.response_width))
    metrics = ppo.compute_advantage(batch, whiten_fn=vdist.global_masked_whiten)
    advantages = torch.cat(vdist.gather_object(batch.advantages))  # rank order = the global batch's row order
    if ppo.needs_critic:
        metrics.update(trainer._update("critic", batch, ppo.compute_value_loss, 1, cfg.actor.micro_batch_size,
                                       cfg.actor.max_tokens_per_micro_batch)[0])
    import verl_ds.trainer as trainer_module

    formed = []  # the actor's micro-batches (row indices of each mini-batch), as the trainer forms them

    def recording(*args, **kwargs):
        formed.append(micro_batch_groups(*args, **kwargs))
        return formed[-1]

    trainer_module.micro_batch_groups = recording
    metrics.update(trainer._update("actor", batch, ppo.compute_policy_loss, 1, cfg.actor.micro_batch_size,
                                   cfg.actor.max_tokens_per_micro_batch)[0])
    trainer_module.micro_batch_groups = micro_batch_groups
    metrics = reduce_metrics(metrics)
    out = {"metrics": metrics, "advantages": advantages, "micro_batches": formed,
           "split_rows": [(r.local, r.tokens) for r in split_rows],
           "actor_attention": trainer.actor_engine.module.config._attn_implementation,
           "share_prompts": trainer.registry.get("actor").shares_prompts,  # one copy per prompt in packed rows
           "share_prefixes": trainer.registry.get("actor")._share_prefixes,  # and of common response prefixes
           "packed_tokens": {share: pack_shared_prompts(batch.observation, batch.mask, batch.response_width,
                                                        share_prefixes=share).num_tokens for share in (False, True)}}
    for role, params in before.items():  # the update itself: after - before
        after = gathered(engines[role].module)
        out[role] = {k: after[k] - params[k] for k in params}
    if trainer.rank == 0:
        torch.save(out, result_path)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
