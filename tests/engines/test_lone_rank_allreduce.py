"""One rank, no gradient reduction machinery: a ZeRO-0 engine with no data-parallel peer skips DeepSpeed's gradient
all-reduce (a flatten, a reduce over one rank and a copy back of every gradient at each accumulation boundary), and
a ZeRO-3 one reduces its contiguous gradient buckets in place instead of reduce-scattering them (a flatten and a
split at every micro-batch). The parameters after accumulated micro-batches and optimizer steps are bitwise those of
the same engine with DeepSpeed's default path. With two ranks both defaults stay (they average the ranks'
gradients; ``tests/engines/test_offload_choice.py`` checks ZeRO-3's configuration), and ZeRO-1 keeps its
optimizer's reduction."""
import json

import pytest

from dist_testutil import run_ranks

pytestmark = pytest.mark.slow  # DeepSpeed ranks

WORKER = r'''
import json, sys
import torch
from verl_ds import dist as vdist
from verl_ds.config import load_config, validate
from verl_ds.engines.build import build_actor_model, load_tokenizer, make_engine
from engine_job import parity_batch, train_two_steps

stage, default_path = int(sys.argv[2]), sys.argv[3]  # default_path: a DeepSpeed JSON putting DeepSpeed's default back
vdist.init_distributed(vdist.detect_launch(), 300, "cpu")
world = vdist.world_size()
base = ["rollout.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2", f"deepspeed.zero_stage={stage}",
        "trainer.device=cpu", "actor.grad_clip=1.0"]
tok = None

def train(extra=(), allreduce=None):
    global tok
    cfg = load_config(None, base + list(extra))
    derived = validate(cfg, world)
    tok = tok or load_tokenizer(cfg)
    enc, labels = parity_batch(tok)
    torch.manual_seed(0)
    engine = make_engine(build_actor_model(cfg, tok), cfg, derived, "actor", lr=1e-2, grad_clip=1.0)
    info = {"allreduce_skipped": not engine.enable_backward_allreduce,
            "reduce_scatter": getattr(engine.optimizer, "reduce_scatter", None)}
    if allreduce is not None:
        engine.enable_backward_allreduce = allreduce
    train_two_steps(engine, enc, labels)
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        params = {}
        for name, p in engine.module.named_parameters():
            with GatheredParameters([p], modifier_rank=None):
                params[name] = p.detach().clone()
    else:
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return info, params

out, params = train()
if world == 1 and stage in (0, 3):
    _, reference = train(allreduce=True) if stage == 0 else train([f"deepspeed.config_file={default_path}"])
    out["bitwise_equal"] = sorted(params) == sorted(reference) and all(torch.equal(params[k], reference[k])
                                                                         for k in params)
    plain = build_actor_model(load_config(None, [o for o in base if not o.startswith("deepspeed.")]), tok)
    out["moved"] = any(not torch.equal(params[k], v) for k, v in plain.named_parameters() if k in params)
json.dump(out, open(sys.argv[1] % vdist.rank(), "w"))
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,stage,allreduce_skipped,reduce_scatter", [
    (1, 0, True, None), (2, 0, False, None), (1, 1, False, None), (1, 3, False, False)])
def test_one_rank_skips_the_gradient_reduction(tmp_path, world, stage, allreduce_skipped, reduce_scatter):
    default = tmp_path / "deepspeed_default.json"
    default.write_text(json.dumps({"zero_optimization": {"reduce_scatter": True}}))
    results = run_ranks(WORKER, world, tmp_path, args=(stage, default), timeout=500)
    for out in results:
        assert out["allreduce_skipped"] is allreduce_skipped, out
        if stage == 3:
            assert out["reduce_scatter"] is reduce_scatter, out
        if "bitwise_equal" in out:
            assert out["moved"], "the optimizer steps left the weights where they were: nothing was compared"
            assert out["bitwise_equal"], "skipping the one-rank reduction changed the update"
