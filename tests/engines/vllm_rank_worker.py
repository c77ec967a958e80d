"""One rank of the two-rank colocated test: the trainer's layout, on gloo.

argv: model_dir out_prefix; RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment. DeepSpeed's process
group first, a ZeRO-3 engine around the HF model taking one AdamW step on rank-specific data, then a vLLM engine
in-process; each rank generates a different amount of work before and after syncing the ZeRO-3 weights module
by module, closes the engine and all-reduces on the trainer's group. Rank 0 saves the full weights, gathered
with DeepSpeed's own API, as the test's reference.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    import deepspeed
    from transformers import AutoModelForCausalLM

    from verl_ds.engines.vllm_engine import VLLMRolloutEngine, gathered_named_parameters

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    actor, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     config=ds_config)
    assert all(p.ds_tensor.numel() < p.ds_numel for p in actor.module.parameters()), "not partitioned"
    ids = torch.tensor([[1, 5 + rank, 7, 9, 11, 13]])
    actor.backward(actor(input_ids=ids, labels=ids).loss)
    actor.step()

    engine = VLLMRolloutEngine(model_dir, seed=rank)
    prompts = [[1, 5 + i + rank, 7, 9] for i in range(2 + 3 * rank)]
    R = 4 + 4 * rank
    before = engine.generate(prompts, max_new_tokens=R, greedy=True)
    engine.sync_weights(gathered_named_parameters(actor.module))
    after = engine.generate(prompts, max_new_tokens=R, greedy=True)
    engine.close()  # must leave the trainer's group working
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    with deepspeed.zero.GatheredParameters(list(actor.module.parameters())):
        full = {name: p.data.clone() for name, p in actor.module.named_parameters()}
    if rank == 0:
        torch.save(full, f"{out}.pt")
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"world": dist.get_world_size(), "all_reduce": total.item(), "R": R, "prompts": prompts,
                   "before": before.responses.tolist(), "after": after.responses.tolist()}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
