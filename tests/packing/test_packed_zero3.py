"""Packed forwards through real DeepSpeed ZeRO-3 engines (1 rank, gloo, in a subprocess): with the fused LM
head the partitioned head weight is gathered for the forward and the backward and its gradient reduced by
DeepSpeed's module hooks, so one SGD step gives the same weights as the logits path and as plain torch."""
import pytest
from packing_testutil import run_zero3_worker

pytestmark = pytest.mark.slow  # real training runs / several processes


WORKER = r'''
import copy, json, sys
import torch
import deepspeed

sys.path.insert(0, sys.argv[2])
from packing_testutil import padded_batch, tiny_critic, tiny_lm
from verl_ds.models.packed_forward import packed_logprobs, packed_values
from verl_ds.models.varlen_attention import use_varlen_attention
from verl_ds.packing import pack


torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      "gradient_clipping": 0.0,
      "zero_allow_untested_optimizer": True}
R = 6
obs, mask = padded_batch([5, 1, 3], [6, 1, 4], 5, R, "left", seed=0)
rmask = mask[:, -R:].float()
p = pack(obs, mask)


def loss_of(lp, ent):
    return -(lp * rmask).sum() / rmask.sum() - 0.1 * (ent * rmask).sum() / rmask.sum()


base = use_varlen_attention(tiny_lm("llama", seed=1))
init = {n: t.detach().clone() for n, t in base.named_parameters()}
out = {}

# plain torch, logits path: the reference step
plain = copy.deepcopy(base)
opt = torch.optim.SGD(plain.parameters(), lr=0.5)
lp, ent = packed_logprobs(plain, p, R, 0.7, compute_entropy=True)
ref_loss = loss_of(lp, ent)
ref_loss.backward()
opt.step()
ref = {n: t.detach().clone() for n, t in plain.named_parameters()}
out["moved"] = min(float((ref[n] - init[n]).abs().max()) for n in ref)

for fused in (False, True):
    lm = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.SGD(lm.parameters(), lr=0.5), config=ds)
    key = "fused" if fused else "logits"
    out[key + "_partitioned"] = all(t.numel() == 0 for t in engine.module.parameters())
    lp, ent = packed_logprobs(engine, p, R, 0.7, compute_entropy=True, fused_lm_head=fused)
    loss = loss_of(lp, ent)
    engine.backward(loss)
    engine.step()
    out[key + "_loss_diff"] = abs(float(loss) - float(ref_loss))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        after = {n: t.detach().clone() for n, t in engine.module.named_parameters()}
    out[key + "_param_diff"] = max(float((after[n] - ref[n]).abs().max()) for n in ref)
    out[key + "_head_moved"] = float((after["lm_head.weight"] - init["lm_head.weight"]).abs().max())

critic = use_varlen_attention(tiny_critic("llama", seed=2))
with torch.no_grad():
    want_v = packed_values(critic, p, R)
critic_e, *_ = deepspeed.initialize(model=critic, config=ds)
with torch.no_grad():
    out["value_diff"] = float((packed_values(critic_e, p, R) - want_v).abs().max())
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''


def test_fused_head_and_packed_forwards_under_zero3():
    out = run_zero3_worker(WORKER)
    assert out["logits_partitioned"] and out["fused_partitioned"]  # real ZeRO-3 partitions
    assert out["moved"] > 1e-4  # the step changed every parameter
    for key in ("logits", "fused"):
        assert out[key + "_head_moved"] > 1e-4, key  # the LM head got its gradient through DeepSpeed
        assert out[key + "_loss_diff"] < 1e-5, key
        assert out[key + "_param_diff"] < 1e-5, key  # the same step as plain torch
    assert out["value_diff"] < 1e-5
