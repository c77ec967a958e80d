"""A ZeRO-0 engine with no data-parallel peer skips DeepSpeed's gradient all-reduce (a flatten, a reduce over one
rank and a copy back of every gradient at each accumulation boundary): the parameters after accumulated
micro-batches and an optimizer step are bitwise those of the same engine with the all-reduce left on. With two
ranks the all-reduce stays (it averages the ranks' gradients), and other stages keep their ZeRO optimizer's."""
import pytest

from dist_testutil import run_ranks

pytestmark = pytest.mark.slow  # DeepSpeed ranks

WORKER = r'''
import json, sys
import torch
from verl_ds import dist as vdist
from verl_ds.config import load_config, validate
from verl_ds.engines.build import build_actor_model, load_tokenizer, make_engine

stage = int(sys.argv[2])
vdist.init_distributed(vdist.detect_launch(), 300, "cpu")
world = vdist.world_size()
cfg = load_config(None, ["rollout.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
                         f"deepspeed.zero_stage={stage}", "trainer.device=cpu", "actor.grad_clip=1.0"])
derived = validate(cfg, world)
tok = load_tokenizer(cfg)
enc = tok(["even : 3 8 1 => 8", "odd : 5 2 => 5", "even : 4 4 => 4", "odd : 1 => 1"], return_tensors="pt",
          padding=True)
labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)

def train(allreduce):
    torch.manual_seed(0)
    engine = make_engine(build_actor_model(cfg, tok), cfg, derived, "actor", lr=1e-2, grad_clip=1.0)
    skipped = not engine.enable_backward_allreduce
    if allreduce is not None:
        engine.enable_backward_allreduce = allreduce
    for _ in range(2):  # two optimizer steps of two accumulated micro-batches
        for rows in ([0, 1], [2, 3]):
            loss = engine(input_ids=enc["input_ids"][rows], attention_mask=enc["attention_mask"][rows],
                          labels=labels[rows]).loss
            engine.backward(loss)
            engine.step()
    return skipped, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

out = {}
out["skipped"], params = train(None)
if world == 1 and stage == 0:
    _, reduced = train(True)
    out["bitwise_equal"] = all(torch.equal(params[k], reduced[k]) for k in params)
    out["moved"] = any(not torch.equal(params[k], v) for k, v in build_actor_model(cfg, tok).state_dict().items())
json.dump(out, open(sys.argv[1] % vdist.rank(), "w"))
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,stage,skipped", [(1, 0, True), (2, 0, False), (1, 1, False)])
def test_zero0_engine_alone_skips_the_gradient_allreduce(tmp_path, world, stage, skipped):
    results = run_ranks(WORKER, world, tmp_path, args=(stage,), timeout=500)
    for out in results:
        assert out["skipped"] is skipped, out
        if "bitwise_equal" in out:
            assert out["moved"], "the optimizer steps left the weights where they were: nothing was compared"
            assert out["bitwise_equal"], "skipping the one-rank all-reduce changed the update"
