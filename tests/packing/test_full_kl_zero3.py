"""algo.kl_kind=full_symmetric through real DeepSpeed ZeRO-3 engines (1 rank, gloo, in a subprocess): the actor's
head is gathered by its module hooks for the forward and for the backward's recomputed chunks, the reference's
head is copied while gathered, so one SGD step on the KL gives the same weights as plain torch, in the padded and
the packed layout."""
import pytest
from packing_testutil import run_zero3_worker

pytestmark = pytest.mark.slow  # real DeepSpeed engines in a subprocess


WORKER = r'''
import copy, json, sys
import torch
import deepspeed

sys.path.insert(0, sys.argv[2])
from packing_testutil import padded_batch, tiny_lm
from verl_ds.models import PolicyModel, ReferenceModel
from verl_ds.models.full_kl import logprobs_with_full_kl

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}
R = 6
obs, mask = padded_batch([5, 1, 3], [6, 1, 4], 5, R, "left", seed=0)
rmask = mask[:, -R:].float()
base = tiny_lm("llama", seed=1)
ref_base = copy.deepcopy(base)
with torch.no_grad():
    for t in ref_base.parameters():
        t.add_(0.05 * torch.randn_like(t))
init = {n: t.detach().clone() for n, t in base.named_parameters()}
out = {}
for packed in (False, True):
    key = "packed" if packed else "padded"
    plain = copy.deepcopy(base)
    opt = torch.optim.SGD(plain.parameters(), lr=5.0)
    _, _, kl = logprobs_with_full_kl(PolicyModel(plain, remove_padding=packed),
                                     ReferenceModel(copy.deepcopy(ref_base), remove_padding=packed), obs, obs[:, -R:],
                                     mask, 0.7)
    want_loss = (kl * rmask).sum() / rmask.sum()
    want_loss.backward()
    opt.step()
    want = {n: t.detach().clone() for n, t in plain.named_parameters()}
    out[key + "_moved"] = float((want["lm_head.weight"] - init["lm_head.weight"]).abs().max())
    lm = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.SGD(lm.parameters(), lr=5.0), config=ds)
    ref_engine, *_ = deepspeed.initialize(model=copy.deepcopy(ref_base), config=ds)
    out[key + "_partitioned"] = all(t.numel() == 0 for t in list(engine.module.parameters())
                                    + list(ref_engine.module.parameters()))
    _, _, kl = logprobs_with_full_kl(PolicyModel(engine, remove_padding=packed),
                                     ReferenceModel(ref_engine, remove_padding=packed), obs, obs[:, -R:], mask, 0.7)
    loss = (kl * rmask).sum() / rmask.sum()
    engine.backward(loss)
    engine.step()
    out[key + "_loss_diff"] = abs(float(loss) - float(want_loss))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        after = {n: t.detach().clone() for n, t in engine.module.named_parameters()}
    out[key + "_param_diff"] = max(float((after[n] - want[n]).abs().max()) for n in want)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''


def test_full_kl_step_under_zero3_equals_plain_torch():
    out = run_zero3_worker(WORKER)
    for key in ("padded", "packed"):
        assert out[key + "_partitioned"], key  # real ZeRO-3 partitions, actor and reference
        assert out[key + "_moved"] > 1e-4, key  # the KL's gradient reached the LM head
        assert out[key + "_loss_diff"] < 1e-6, key
        assert out[key + "_param_diff"] < 1e-5, key  # the same step as plain torch
