"""One rank of the vLLM training check (test_vllm_training.py runs it in the vLLM venv, under torchrun):

    python vllm_training_worker.py <out_prefix> <steps> key.sub=value ...

A Trainer with rollout.engine=vllm takes ``steps`` real steps. After each one, on this rank's share of the held-out
prompts: the vLLM engine's greedy tokens, HF generate's greedy tokens on a replica of the actor's current (gathered)
weights, and HF's smallest top-1/top-2 logit gap along each of its greedy rows (a full forward, no KV cache), which
says where a tie makes the comparison meaningless. Each rank writes <out_prefix>.<rank>.json with these and the
step's metrics.
"""
import json
import sys

import torch


@torch.no_grad()
def greedy_gaps(model, input_ids, attention_mask, responses, lengths):
    """Per row: min over its response tokens of (top-1 - top-2) logit of the position that predicts the token."""
    from verl_ds.rows import position_ids_from_mask

    P, R = input_ids.shape[1], responses.shape[1]
    valid = torch.arange(R)[None, :] < lengths[:, None]
    mask = torch.cat([attention_mask.bool(), valid], 1)
    logits = model(input_ids=torch.cat([input_ids, responses], 1), attention_mask=mask.long(),
                   position_ids=position_ids_from_mask(mask)).logits[:, P - 1:P - 1 + R].double()
    top = logits.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).masked_fill(~valid, float("inf"))
    argmax_ok = (logits.argmax(-1) == responses) | ~valid  # HF's cached greedy path is the argmax of a full forward
    return gap.min(-1).values.tolist(), argmax_ok.all(-1).tolist()


def main(out: str, steps: int, overrides: list) -> None:
    from verl_ds.config import load_config
    from verl_ds.data import collate_prompts
    from verl_ds.dist import detect_launch
    from verl_ds.generation import HFRolloutEngine
    from verl_ds.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), detect_launch())
    tok, rank, world = trainer.tokenizer, trainer.rank, trainer.world
    vllm = trainer.registry.get("actor").rollout_engine
    hf = HFRolloutEngine(trainer.actor_engine, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, gather_params=True)
    val = trainer.c.val_set
    prompts = collate_prompts([val[i] for i in range(rank, len(val), world)], tok.pad_token_id)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    R = trainer.cfg.rollout.max_new_tokens
    records = []
    for _ in range(steps):
        metrics = trainer.train_step()
        hf.refresh()  # collective: every rank gathers the actor's new weights into its replica
        v = vllm.generate(ids, mask, max_new_tokens=R, greedy=True)
        h = hf.generate(ids, mask, max_new_tokens=R, greedy=True)
        gaps, argmax_ok = greedy_gaps(hf.replica, ids, mask, h.responses, h.response_length)
        records.append({"metrics": metrics, "vllm": v.responses.tolist(), "vllm_len": v.response_length.tolist(),
                        "hf": h.responses.tolist(), "hf_len": h.response_length.tolist(), "gap": gaps,
                        "hf_argmax": argmax_ok})
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump({"world": world, "syncs": vllm.syncs, "start_s": vllm.start_seconds, "records": records}, fh)
    vllm.close()
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
