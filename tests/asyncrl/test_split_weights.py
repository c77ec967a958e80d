"""Split placement's weight path on 3 real ranks (gloo): ranks 0-1 train a ZeRO-3 actor in their own default group
(DeepSpeed sees a world of 2), rank 2 holds a whole copy built with other weights; after an optimizer step the
trainers' weights go to rank 2 over the bridge group in small buckets (several broadcasts), one module's ZeRO-3
gather at a time. Rank 2's weights then equal the trainer's gathered ones exactly."""
import pytest

from dist_testutil import run_ranks

pytestmark = pytest.mark.slow  # several processes

WORKER = r'''
import json, os, sys
import torch
from verl_ds.asyncrl.placement import receive_weights, send_weights, split_groups
from verl_ds.config import load_config
from verl_ds.config.validate import validate
from verl_ds.engines.build import build_actor_model, build_engines, load_tokenizer
from verl_ds.weights.hf_weights import weight_groups
from verl_ds.weights.zero3 import gathered

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
pl = split_groups(rank, world, "127.0.0.1", int(os.environ["MASTER_PORT"]), rollout_ranks=1, timeout_s=120)
assert pl.weights is None and pl.weight_group is pl.bridge and pl.device == "cpu"  # CPU: the weights take gloo
cfg = load_config(None, ["model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64",
                         "deepspeed.zero_stage=3",
                         "rollout.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
                         "trainer.device=cpu"])
tok = load_tokenizer(cfg)
digest = lambda named: {n: [float(t.double().sum()), float(t.double().abs().sum())] for n, t in named}
if pl.role == "train":
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # the training ranks' group, already made
    engine = build_engines(cfg, validate(cfg, pl.n_train), tok, roles=("actor",))["actor"]
    assert engine.dp_world_size == 2 and torch.distributed.get_world_size() == 2
    ids = torch.randint(0, len(tok), (2, 6), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids).logits.float().pow(2).mean()
    engine.backward(loss)
    engine.step()  # the weights are no longer the initial ones
    seconds = send_weights(engine.module, pl, bucket_bytes=4096)
    named = []
    for params, outs in weight_groups(engine.module):
        with gathered(params):
            named += [(n, produce().detach().clone()) for n, _, _, produce in outs]
    result = {"role": "train", "weights": digest(named), "seconds": seconds}
else:
    model = build_actor_model(cfg, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # surely other weights than the trainer's
    before = digest(model.named_parameters())
    seconds = receive_weights(model, pl, bucket_bytes=4096)
    result = {"role": "rollout", "weights": digest(model.named_parameters()), "before": before, "seconds": seconds}
json.dump(result, open(sys.argv[1] % rank, "w"))
'''


def test_trainer_weights_reach_the_generation_rank_over_the_bridge(tmp_path):
    r0, r1, r2 = run_ranks(WORKER, 3, tmp_path, timeout=600)
    assert (r0["role"], r1["role"], r2["role"]) == ("train", "train", "rollout")
    assert r0["weights"] == r1["weights"]  # both trainers gathered the same full weights
    assert set(r2["weights"]) == set(r0["weights"])
    assert r2["weights"] == r0["weights"]  # exactly: sums of every tensor, plain and absolute
    assert r2["before"] != r2["weights"]
    assert r2["seconds"] > 0
