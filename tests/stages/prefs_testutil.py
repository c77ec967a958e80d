"""Shared pieces of the reward-model and DPO job tests: a small preference file (text and chat rows), a job built in
this process (one rank, a real DeepSpeed engine, a tiny Llama), the job's weights gathered into float64 HF models, and
the float64 loops the jobs' losses are checked against."""
import json
import math

import torch

from verl_ds.config import load_config
from verl_ds.dist import detect_launch

CHAT_PROMPT = [{"role": "user", "content": "even : 3 8"}]
PAIRS = [
    {"prompt": "even : 3 8 =>", "chosen": "2 4 6", "rejected": "1 3"},
    {"prompt": "odd : 1 2 =>", "chosen": "5 7", "rejected": "4 4 4 4"},
    {"prompt": CHAT_PROMPT, "chosen": [{"role": "assistant", "content": "2 8"}],
     "rejected": [{"role": "assistant", "content": "9"}]},
    {"chosen": "even : 0 => 0 2", "rejected": "even : 0 => 1 2 3"},  # implicit prompt
    {"prompt": "odd : 9 9 9 =>", "chosen": "1", "rejected": "2 2"},
    {"prompt": "even :", "chosen": "8 8 8 8 8", "rejected": "7"},
    {"prompt": "odd : 0 =>", "chosen": "3 5", "rejected": "3 6"},
    {"prompt": "even : 5 =>", "chosen": "0", "rejected": "5 5"},
]
SMALL = ["model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "trainer.loggers=[]", "rollout.max_new_tokens=8"]


def write_pairs(tmp_path, rows=PAIRS) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_job(job_cls, tmp_path, *overrides, rows=PAIRS):
    from e2e_utils import merged

    cfg = load_config(None, merged([f"trainer.output_dir={tmp_path / 'run'}",
                                    f"data.train_files={write_pairs(tmp_path, rows)}"], SMALL, overrides))
    return job_cls(cfg, detect_launch({}))


def gathered_state(module) -> dict:
    """{name: float64 copy} of every parameter of ``module`` (gathered when ZeRO-3 partitions it)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    state = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p], modifier_rank=None):
            state[name] = p.detach().to(torch.float64, copy=True)
    return state


def float64_model(auto_cls, config, state: dict):
    model = auto_cls.from_config(config).double().eval()
    model.load_state_dict(state)
    return model


@torch.no_grad()
def loop_rewards(model, items) -> list:
    """[(r_chosen, r_rejected)]: each sequence alone, unpadded, the classifier's output at its last token."""
    out = []
    for x in items:
        pair = []
        for key in ("chosen_ids", "rejected_ids"):
            seq = torch.tensor([x["prompt_ids"] + x[key]])
            pair.append(float(model(seq).logits.reshape(-1)[-1]))  # (1, 1): pooled at the last (non-pad) token
        out.append(tuple(pair))
    return out


@torch.no_grad()
def loop_logps(model, items, average: bool = False) -> list:
    """[(log p(chosen | prompt), log p(rejected | prompt))]: each sequence alone, unpadded, summed (or averaged) over
    the completion tokens."""
    out = []
    for x in items:
        pair = []
        for key in ("chosen_ids", "rejected_ids"):
            seq = x["prompt_ids"] + x[key]
            lp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            P = len(x["prompt_ids"])
            total = sum(float(lp[t - 1, seq[t]]) for t in range(P, len(seq)))
            pair.append(total / len(x[key]) if average else total)
        out.append(tuple(pair))
    return out


def log1p_exp(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x)) if x < 30 else x
