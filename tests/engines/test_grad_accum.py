"""verl_ds.engines.grad_accum: a Linear whose weight gradient is added into .grad by its product (Megatron-LM's
gradient-accumulation fusion) gives the gradients autograd's accumulation gives, without running the weight's
AccumulateGrad; a DeepSpeed ZeRO-0 engine gets it (same update as with it off), a ZeRO-1 engine does not."""
import copy

import pytest
import torch

from dist_testutil import run_ranks
from verl_ds.engines.grad_accum import GradAccumLinear, fuse_grad_accumulation


def _net(bias: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7, bias=bias), torch.nn.Tanh(), torch.nn.Linear(7, 3, bias=bias)).double()


def _accumulate(net, batches) -> dict:
    for x in batches:
        (net(x).sin().sum()).backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


@pytest.mark.parametrize("bias", [True, False])
def test_three_micro_batches_accumulate_autograds_gradients(bias):
    plain = _net(bias)
    fused = copy.deepcopy(plain)
    assert fuse_grad_accumulation(fused) == 2 and all(type(m) is GradAccumLinear for m in (fused[0], fused[2]))
    torch.manual_seed(1)
    batches = [torch.randn(2, 4, 5, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64),
               torch.randn(3, 6, 5, dtype=torch.float64).transpose(0, 1)]  # 3-D, 2-D, non-contiguous
    expected, got = _accumulate(plain, batches), _accumulate(fused, batches)
    assert sorted(expected) == sorted(got)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_activation_checkpointing(reentrant):
    """A saved parameter unpacks as another tensor object under checkpointing: the gradient must still reach the
    parameter (a LoRA actor with model.gradient_checkpointing lost every gradient before this was handled)."""
    from torch.utils.checkpoint import checkpoint

    plain = _net(True)
    fused = copy.deepcopy(plain)
    fuse_grad_accumulation(fused)
    torch.manual_seed(3)
    xs = [torch.randn(3, 5, dtype=torch.float64, requires_grad=reentrant) for _ in range(2)]  # frozen inputs too
    for net in (plain, fused):
        for x in xs:
            checkpoint(lambda t, net=net: net(t).sin().sum(), x, use_reentrant=reentrant).backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12)


def test_the_second_micro_batch_adds_each_product_into_the_gradient_in_one_op():
    from torch.profiler import ProfilerActivity, profile

    def ops(net):
        torch.manual_seed(2)
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        net(x).square().sum().backward()  # the first micro-batch: fresh gradients
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            net(x).square().sum().backward()
        return x.grad, [(e.name, tuple(e.input_shapes[0]) if e.input_shapes else ()) for e in prof.events()]

    plain = _net(False)
    fused = copy.deepcopy(plain)
    fuse_grad_accumulation(fused)
    weight_shapes = {(7, 5), (3, 7)}
    x_plain, plain_ops = ops(plain)
    x_fused, fused_ops = ops(fused)
    assert {shape for name, shape in plain_ops if name == "aten::add_"} >= weight_shapes  # AccumulateGrad's add
    assert not {shape for name, shape in fused_ops if name == "aten::add_"} & weight_shapes
    assert {shape for name, shape in fused_ops if name == "aten::addmm_"} == weight_shapes
    torch.testing.assert_close(x_fused, x_plain, rtol=1e-12, atol=1e-12)  # and the input gradient is the same


def test_frozen_weights_hooked_weights_and_no_grad_keep_the_plain_path():
    net = _net(True)
    net[0].weight.requires_grad_(False)
    net[2].weight.register_post_accumulate_grad_hook(lambda p: None)  # someone listens: leave it to autograd
    assert fuse_grad_accumulation(net) == 0 and type(net[0]) is torch.nn.Linear
    lin = GradAccumLinear(5, 3).double()
    x = torch.randn(2, 5, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-12, atol=1e-12)
    lin.weight.requires_grad_(False)
    lin(x).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is not None
    torch.testing.assert_close(lin.bias.grad, torch.full((3,), 2.0, dtype=torch.float64))


WORKER = r'''
import json, sys
import torch
from verl_ds import dist as vdist
from verl_ds.config import load_config
from verl_ds.engines.build import build_actor_model, make_engine
from verl_ds.engines.grad_accum import GradAccumLinear
from engine_job import BASE, setup, train_two_steps

vdist.init_distributed(vdist.detect_launch(), 300, "cpu")

def train(extra):
    cfg, derived, tok, enc, labels = setup(extra)
    engine = make_engine(build_actor_model(cfg, tok), cfg, derived, "actor", lr=1e-2, grad_clip=1.0)
    fused = sum(type(m) is GradAccumLinear for m in engine.module.modules())
    grads = {}

    def keep_first_step_grads(step, rows):  # the gradients of the first step, both micro-batches accumulated
        if step == 0 and rows[0] == 2 and cfg.deepspeed.zero_stage == 0:
            grads.update({k: p.grad.clone() for k, p in engine.module.named_parameters()})

    train_two_steps(engine, enc, labels, keep_first_step_grads)
    return fused, grads or None, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

out = {}
fused, g1, p1 = train(["deepspeed.zero_stage=0"])
_, g0, p0 = train(["deepspeed.zero_stage=0", "deepspeed.grad_accumulation_fusion=false"])
out["fused_zero0"] = fused
out["unfused_when_off"] = train(["deepspeed.zero_stage=0", "deepspeed.grad_accumulation_fusion=false"])[0] == 0
out["fused_zero1"] = train(["deepspeed.zero_stage=1"])[0]
out["grad_diff"] = max(((g1[k] - g0[k]).abs().max() / g0[k].abs().max().clamp(min=1e-12)).item() for k in g0)
out["param_diff"] = max((p1[k] - p0[k]).abs().max().item() for k in p0)
out["moved"] = max((p0[k] - v).abs().max().item() for k, v in build_actor_model(load_config(None, BASE), setup()[2])
                   .state_dict().items() if k in p0)
json.dump(out, open(sys.argv[1] % vdist.rank(), "w"))
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_zero0_engine_fuses_with_the_same_update_and_zero1_does_not(tmp_path):
    (out,) = run_ranks(WORKER, 1, tmp_path, timeout=500)
    n_linear = 2 * 7 + 1  # the default tiny Llama: 2 layers of q, k, v, o, gate, up, down, and the LM head
    assert out["fused_zero0"] == n_linear, out
    assert out["unfused_when_off"] and out["fused_zero1"] == 0, out
    assert out["moved"] > 1e-4, "the optimizer steps left the weights where they were: nothing was compared"
    assert out["grad_diff"] < 1e-6 and out["param_diff"] < 1e-6, out
