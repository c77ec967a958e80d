"""One rank of the two-rank colocated test: gloo group first (as the trainer does), then a vLLM engine in-process.

argv: model_dir out_json; RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment. Each rank generates a
different amount of work, syncs weights scaled by 1 + (1 + rank) / 100, closes the engine, then all-reduces.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=300))
    from transformers import AutoModelForCausalLM

    from verl_ds.engines.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(model_dir, seed=rank)
    prompts = [[1, 5 + i + rank, 7, 9] for i in range(2 + 3 * rank)]
    before = engine.generate(prompts, max_new_tokens=4 + 4 * rank, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1 + (1 + rank) / 100)
    engine.sync_weights((n, p.detach()) for n, p in hf.named_parameters())
    after = engine.generate(prompts, max_new_tokens=4 + 4 * rank, greedy=True)
    engine.close()  # must leave the trainer's group working
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(), "all_reduce": total.item(),
                   "before": before.responses.tolist(), "after": after.responses.tolist(),
                   "prompts": prompts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
