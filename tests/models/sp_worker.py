"""One rank of test_sequence_parallel.py (2 gloo ranks, RANK/WORLD_SIZE/MASTER_* set): float64 tiny Llama actor and
critic; the same packed micro-batch scored with model.sequence_parallel_size=2 (each rank a slice of the row) and
unsplit on each rank; writes the largest differences of log-probs, entropies, values and parameter gradients (the
group's gradients summed) to <out>/rank<r>.json."""
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from models_testutil import EOS, PAD, make_rollout_batch, tiny_llama_config  # noqa: E402


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def group_sum(g: dict, sp) -> dict:
    import torch.distributed as dist

    for t in g.values():
        dist.all_reduce(t, group=sp.group)
    return g


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-300)) for k in a)


def main(out_dir: str) -> None:
    import deepspeed

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    from transformers import LlamaForCausalLM

    from verl_ds.batch import RolloutBatch
    from verl_ds.models import PolicyModel, ReferenceModel, ValueModel
    from verl_ds.models.full_kl import logprobs_with_full_kl
    from verl_ds.models.sequence_parallel import init_sequence_parallel, register_ulysses
    from verl_ds.models.value import CriticLM
    from verl_ds.models.varlen_attention import VARLEN_ATTENTION, use_attention

    torch.manual_seed(0)
    sp = init_sequence_parallel(2)
    wrapped = register_ulysses(VARLEN_ATTENTION)
    cfg = tiny_llama_config(torch_dtype=torch.float64)
    lm = LlamaForCausalLM(cfg).double()
    critic = CriticLM.from_causal_lm_config(cfg).double()
    # one batch, two samples per prompt (shared prompts), odd packed length (the row is padded to split it)
    base = make_rollout_batch(B=3, P=7, R=6, seed=3, eos_rows=(1,))
    batch = RolloutBatch.cat([base.select([0, 0, 1, 2]), make_rollout_batch(B=1, P=7, R=6, seed=5)])
    obs, mask, act = batch.observation, batch.mask, batch.action
    rm = batch.response_mask.double()
    w = torch.linspace(-1, 1, rm.numel(), dtype=torch.float64).view_as(rm) * rm  # a loss with every token weighted
    out = {}
    for name, kw in {"packed": {}, "shared": {"share_prompts": True, "share_prefixes": True},
                     "fused": {"fused_lm_head": True}, "fused_shared": {"fused_lm_head": True, "share_prompts": True}
                     }.items():
        runs = {}
        for split in (False, True):
            model = copy.deepcopy(lm)
            use_attention(model, wrapped if split else VARLEN_ATTENTION)
            policy = PolicyModel(model, remove_padding=True, sequence_parallel=sp if split else None, **kw)
            lp, ent = policy.get_logprob(obs, act, mask, temperature=0.7, return_entropy=True)
            ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
            g = grads(model)
            runs[split] = (lp.detach(), ent.detach(), group_sum(g, sp) if split else g)
        (lp1, ent1, g1), (lp2, ent2, g2) = runs[False], runs[True]
        out[name] = {"log_probs": float(((lp1 - lp2) * rm).abs().max()),
                     "entropy": float(((ent1 - ent2) * rm).abs().max()),
                     "grads": worst(g2, g1), "grad_count": len(g1), "lp_scale": float((lp1 * rm).abs().max())}
    runs = {}  # algo.kl_kind=full_symmetric: the reference's final hidden states ride along in the actor's head
    ref_lm = LlamaForCausalLM(cfg).double()
    for split in (False, True):
        model, ref_model = copy.deepcopy(lm), copy.deepcopy(ref_lm)
        for m in (model, ref_model):
            use_attention(m, wrapped if split else VARLEN_ATTENTION)
        kw = dict(remove_padding=True, share_prompts=True, sequence_parallel=sp if split else None)
        lp, ent, kl = logprobs_with_full_kl(PolicyModel(model, **kw), ReferenceModel(ref_model, **kw), obs, act,
                                            mask, 0.7)
        ((lp * w).sum() + (kl * w.flip(0)).sum()).backward()
        g = grads(model)
        runs[split] = (kl.detach(), group_sum(g, sp) if split else g)
    out["full_kl"] = {"kl": float(((runs[False][0] - runs[True][0]) * rm).abs().max()),
                      "kl_scale": float((runs[False][0] * rm).abs().max()),
                      "grads": worst(runs[True][1], runs[False][1])}
    runs = {}
    for split in (False, True):
        net = copy.deepcopy(critic)
        use_attention(net, wrapped if split else VARLEN_ATTENTION)
        values = ValueModel(net, remove_padding=True, sequence_parallel=sp if split else None).get_values(
            obs, mask, batch.response_width)
        (values * w).sum().backward()
        g = grads(net)
        runs[split] = (values.detach(), group_sum(g, sp) if split else g)
    out["values"] = {"values": float(((runs[False][0] - runs[True][0]) * rm).abs().max()),
                     "grads": worst(runs[True][1], runs[False][1]), "grad_count": len(runs[False][1])}
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
