"""verl_ds.engines.cpu_linear: Linear layers of float32 CPU models on oneDNN. The outputs and every gradient are
those of float64 autograd (to float32 rounding), the oneDNN op is really the one that runs, other dtypes and
autocast keep F.linear, the conversion is by class (parameters, state dict, GradAccumLinear and replicas follow),
and ``model.cpu_linear`` resolves as documented."""
import copy

import pytest
import torch

from verl_ds.engines import cpu_linear
from verl_ds.engines.cpu_linear import OneDNNLinear, linear, resolve_cpu_linear, use_onednn_linears, uses_onednn
from verl_ds.engines.grad_accum import GradAccumLinear, fuse_grad_accumulation

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="torch without oneDNN")
ONEDNN_OP = "mkldnn::_linear_pointwise"


@pytest.fixture(autouse=True)
def every_product_on_onednn(monkeypatch):
    """These tests' products are small: take oneDNN whatever the size (the size rule has its own test)."""
    monkeypatch.setattr(cpu_linear, "MIN_MACS", 0)


def _ops(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


@needs_onednn
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 37), (1, 1, 37), (0, 37), (37,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_x_wt_plus_b(shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(19, 37)
    b = torch.randn(19) if bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if x.numel():
        assert ONEDNN_OP in _ops(lambda: linear(x, w, b))


@needs_onednn
@needs_onednn
def test_products_under_min_macs_stay_on_f_linear(monkeypatch):
    """oneDNN's per-call cost outweighs its gain on small products (the default tiny model's): below MIN_MACS
    multiply-adds (tokens x in x out) F.linear runs, from it on oneDNN."""
    monkeypatch.setattr(cpu_linear, "MIN_MACS", 1 << 24)
    w = torch.randn(256, 512)
    small, big = torch.randn(127, 512), torch.randn(1, 128, 512)  # 127 x 512 x 256 < 2^24 <= 128 x 512 x 256
    assert ONEDNN_OP not in _ops(lambda: linear(small, w))
    assert torch.equal(linear(small, w), torch.nn.functional.linear(small, w))
    assert ONEDNN_OP in _ops(lambda: linear(big, w))
    assert ONEDNN_OP in _ops(lambda: cpu_linear.linear_input_grad(torch.randn(128, 256), w))  # 128 x 256 x 512


def test_layers_too_small_to_reach_min_macs_keep_torchs_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_MACS", 1 << 24)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(512, 256), torch.nn.Linear(512, 18))
    # 64 x 128 and 512 x 18 stay under 2^24 at 1024 tokens; 512 x 256 reaches it at 128
    assert use_onednn_linears(net) == 1
    assert [type(m) for m in net] == [torch.nn.Linear, OneDNNLinear, torch.nn.Linear]
    fused = GradAccumLinear(64, 128)
    assert use_onednn_linears(fused) == 0 and not fused.onednn


@needs_onednn
def test_non_contiguous_inputs_and_a_transposed_weight():
    torch.manual_seed(1)
    x = torch.randn(4, 3, 11).transpose(0, 1)  # (3, 4, 11), not contiguous
    w = torch.randn(11, 6).t()  # (6, 11) view
    torch.testing.assert_close(linear(x, w).double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    dy = torch.randn(3, 4, 6)
    torch.testing.assert_close(cpu_linear.linear_input_grad(dy, w).double(), dy.double() @ w.double(),
                               rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_cpu_autocast_keep_f_linear():
    torch.manual_seed(2)
    x, w, b = (torch.randn(*shape, dtype=torch.float64) for shape in ((3, 5), (4, 5), (4,)))
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))  # float64: bitwise F.linear
    assert ONEDNN_OP not in _ops(lambda: linear(x, w, b))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(linear(xb, wb), torch.nn.functional.linear(xb, wb))
    x32, w32 = x.float(), w.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x32, w32)
        assert out.dtype == torch.bfloat16  # autocast's F.linear, not a float32 oneDNN product
        assert ONEDNN_OP not in _ops(lambda: linear(x32, w32))


def _net(bias=True) -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(13, 17, bias=bias), torch.nn.Tanh(), torch.nn.Linear(17, 5, bias=bias))


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_every_gradient_match_float64_autograd(bias):
    ref = _net(bias).double()
    net = _net(bias)
    assert use_onednn_linears(net) == 2 and all(type(net[i]) is OneDNNLinear for i in (0, 2))
    torch.manual_seed(4)
    x = torch.randn(2, 7, 13, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    target = torch.randn(2, 7, 5)
    ((net(x) - target) ** 2).sum().backward()
    ((ref(x64) - target.double()) ** 2).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-5, msg=name)
    ops = _ops(lambda: net(x).sum().backward())
    assert ops.count(ONEDNN_OP) == 2 + 2  # both forwards and both input gradients


@needs_onednn
def test_a_frozen_weight_passes_the_input_gradient_only():
    """A LoRA base layer: frozen weight and bias, an input that needs its gradient."""
    lin = torch.nn.Linear(6, 4)
    ref = copy.deepcopy(lin).double()
    use_onednn_linears(lin)
    lin.requires_grad_(False)
    x = torch.randn(3, 6, requires_grad=True)
    x64 = x.detach().double().requires_grad_(True)
    lin(x).square().sum().backward()
    ref.requires_grad_(False)
    ref(x64).square().sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no grad anywhere: no autograd node at all
        assert lin(x).grad_fn is None


@needs_onednn
def test_grad_accum_linear_on_onednn_accumulates_float64_autograds_gradients():
    ref = _net().double()
    net = _net()
    use_onednn_linears(net)
    assert fuse_grad_accumulation(net) == 2  # OneDNNLinear -> GradAccumLinear, still on oneDNN
    assert all(type(net[i]) is GradAccumLinear and net[i].onednn for i in (0, 2)) and uses_onednn(net)
    torch.manual_seed(5)
    batches = [torch.randn(4, 13), torch.randn(2, 3, 13), torch.randn(5, 2, 13).transpose(0, 1)]
    for x in batches:
        net(x).sin().sum().backward()
        ref(x.double()).sin().sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert ONEDNN_OP in _ops(lambda: net(batches[0]).sum().backward())
    fused_first = _net()
    fuse_grad_accumulation(fused_first)  # the other order: GradAccumLinear first, then oneDNN
    assert use_onednn_linears(fused_first) == 2 and all(fused_first[i].onednn for i in (0, 2))


def test_conversion_keeps_parameters_and_state_and_leaves_subclasses_alone():
    class Owned(torch.nn.Linear):  # e.g. a library's own Linear subclass
        pass

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), Owned(4, 2), torch.nn.Embedding(5, 3))
    params, state = list(net.parameters()), copy.deepcopy(net.state_dict())
    assert not uses_onednn(net)
    assert use_onednn_linears(net) == 1
    assert type(net[0]) is OneDNNLinear and type(net[1]) is Owned and uses_onednn(net)
    assert all(a is b for a, b in zip(net.parameters(), params))
    assert net.state_dict().keys() == state.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    assert use_onednn_linears(net) == 0  # already converted


@needs_onednn
def test_a_generation_replica_takes_its_sources_backend():
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ds.engines.replica import GenerationReplica

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(6)
    source = LlamaForCausalLM(cfg)
    plain = GenerationReplica(source).model
    assert not uses_onednn(plain)
    use_onednn_linears(source)
    replica = GenerationReplica(source)
    replica.refresh()
    assert uses_onednn(replica.model)
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(replica.model(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_resolve(monkeypatch):
    with pytest.raises(ValueError, match="model.cpu_linear must be one of"):
        resolve_cpu_linear("mkl")
    assert resolve_cpu_linear("torch") == "torch"
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: True)
    for vendor, capability, want in (("AuthenticAMD", "AVX512", "onednn"), ("AuthenticAMD", "AVX2", "torch"),
                                     ("GenuineIntel", "AVX512", "torch"), ("", "AVX512", "torch")):
        monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert resolve_cpu_linear("auto") == want, (vendor, capability)
        assert resolve_cpu_linear("onednn") == "onednn"
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: "AuthenticAMD")
    assert resolve_cpu_linear("auto") == "torch"
    with pytest.raises(ValueError, match="no oneDNN inner product"):
        resolve_cpu_linear("onednn")


def test_the_config_gate_refuses_onednn_without_it(monkeypatch, tmp_path):
    from verl_ds.config import ConfigError, check_startup, load_config

    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    cfg = load_config(None, ["model.cpu_linear=onednn", f"trainer.output_dir={tmp_path}/run"])
    with pytest.raises(ConfigError, match="model.cpu_linear: 'onednn'"):
        check_startup(cfg)
    with pytest.raises(ConfigError, match="model.cpu_linear"):
        load_config(None, ["model.cpu_linear=mkl"])


WORKER = r'''
import json, sys
import torch
from verl_ds import dist as vdist
from verl_ds.config import load_config
from verl_ds.engines import cpu_linear
from verl_ds.engines.build import build_actor_model, make_engine
from verl_ds.engines.cpu_linear import OneDNNLinear
from verl_ds.engines.grad_accum import GradAccumLinear
from engine_job import BASE, setup, train_two_steps

cpu_linear.MIN_MACS = 0  # the tiny model's products are small: oneDNN for every one of them
vdist.init_distributed(vdist.detect_launch(), 300, "cpu")

def train(extra):
    cfg, derived, tok, enc, labels = setup(extra)
    actor = make_engine(build_actor_model(cfg, tok), cfg, derived, "actor", lr=1e-2, grad_clip=1.0)
    ref = make_engine(build_actor_model(cfg, tok), cfg, derived, "ref")
    kinds = {"grad_accum_onednn": sum(type(m) is GradAccumLinear and m.onednn for m in actor.module.modules()),
             "actor_onednn": sum(type(m) is OneDNNLinear for m in actor.module.modules()),
             "ref_onednn": sum(type(m) is OneDNNLinear for m in ref.module.modules())}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_two_steps(actor, enc, labels)
        with torch.no_grad():
            ref_logits = ref(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    kinds["onednn_calls"] = sum(e.name == "mkldnn::_linear_pointwise" for e in prof.events())
    params = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    if cfg.deepspeed.zero_stage == 3:
        from deepspeed import zero
        with zero.GatheredParameters(list(actor.module.parameters())):
            params = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    return kinds, params, ref_logits

out = {}
for stage in (0, 3):
    kinds, p1, r1 = train([f"deepspeed.zero_stage={stage}", "model.cpu_linear=onednn"])
    kinds0, p0, r0 = train([f"deepspeed.zero_stage={stage}", "model.cpu_linear=torch"])
    out[f"z{stage}"] = {**kinds, "torch_onednn_modules": sum(kinds0.values()),  # with the onednn_calls count
                        "param_diff": max((p1[k] - p0[k]).abs().max().item() for k in p0),
                        "ref_logit_diff": (r1 - r0).abs().max().item(),
                        "moved": max((p0[k] - v).abs().max().item() for k, v in build_actor_model(
                            load_config(None, BASE), setup()[2]).state_dict().items() if k in p0)}
json.dump(out, open(sys.argv[1] % vdist.rank(), "w"))
'''


@needs_onednn
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_engines_train_alike_on_both_backends_at_zero0_and_zero3(tmp_path):
    """DeepSpeed engines with model.cpu_linear=onednn: the ZeRO-0 actor's fused Linears and the ZeRO-3 actor's
    plain ones (gradients through DeepSpeed's partitioning hooks) and the frozen reference run on oneDNN, and two
    optimizer steps land where the torch backend's do (float32 last-bit differences only)."""
    from dist_testutil import run_ranks

    (out,) = run_ranks(WORKER, 1, tmp_path, timeout=500)
    n_linear = 2 * 7 + 1  # the default tiny Llama: 2 layers of q, k, v, o, gate, up, down, and the LM head
    z0, z3 = out["z0"], out["z3"]
    assert z0["grad_accum_onednn"] == n_linear and z0["actor_onednn"] == 0 and z0["ref_onednn"] == n_linear, out
    assert z3["grad_accum_onednn"] == 0 and z3["actor_onednn"] == n_linear and z3["ref_onednn"] == n_linear, out
    assert z0["torch_onednn_modules"] == 0 and z3["torch_onednn_modules"] == 0, out
    # 4 micro-batches x (forward + input gradient) x 15 Linears, and the reference's forward: all on oneDNN
    assert z0["onednn_calls"] == z3["onednn_calls"] == 4 * 2 * n_linear + n_linear, out
    for z in (z0, z3):
        assert z["moved"] > 1e-4, "the optimizer steps left the weights where they were: nothing was compared"
        assert z["param_diff"] < 1e-5 and z["ref_logit_diff"] < 1e-5, out
