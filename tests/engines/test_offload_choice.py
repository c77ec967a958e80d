"""Which optimizer and offload settings a run gets: DeepSpeed's CPU Adam over pinned memory when the optimizer is
offloaded from a GPU, torch AdamW otherwise (CPU runs need no compiled op). Pure functions of the config: no
GPU is needed to check the choice (the GPU path itself is not run here: this machine has none)."""
import pytest

from verl_ds.config import load_config, validate
from verl_ds.engines.build import OPTIMIZERS, optimizer_name
from verl_ds.engines.ds_config import make_ds_config


def _cfg(*overrides):
    cfg = load_config(None, list(overrides))
    return cfg, validate(cfg)


@pytest.mark.parametrize("device,offload,stage,expected", [
    ("cuda", True, 3, "deepspeed_cpu_adam"),
    ("cuda", True, 2, "deepspeed_cpu_adam"),
    ("cuda", False, 3, "torch_adamw"),
    ("cuda", True, 0, "torch_adamw"),  # stage 0 ignores an offloaded optimizer
    ("cpu", True, 3, "torch_adamw"),
])
def test_optimizer_choice(device, offload, stage, expected):
    cfg, _ = _cfg(f"trainer.device={device}", f"deepspeed.offload={['optimizer'] if offload else []}",
                  f"deepspeed.zero_stage={stage}")
    assert optimizer_name(cfg) == expected and expected in OPTIMIZERS


def test_gpu_offload_pins_memory_and_lets_deepspeed_keep_its_cpu_adam():
    cfg, d = _cfg("deepspeed.offload=[optimizer, param]")
    gpu = make_ds_config(cfg, d, "actor", gpu=True)
    zero = gpu["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "zero_force_ds_cpu_optimizer" not in gpu
    cpu = make_ds_config(cfg, d, "actor", gpu=False)
    assert cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cpu["zero_force_ds_cpu_optimizer"] is False  # torch AdamW on a CPU run
    # params offloaded from a GPU with the optimizer on it: torch AdamW, so DeepSpeed must not insist on its own
    cfg2, d2 = _cfg("deepspeed.offload=[param]")
    assert make_ds_config(cfg2, d2, "actor", gpu=True)["zero_force_ds_cpu_optimizer"] is False


def test_device_is_read_from_the_config_when_not_given():
    cfg, d = _cfg("deepspeed.offload=[optimizer]", "trainer.device=cuda")
    assert make_ds_config(cfg, d, "actor")["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    cfg, d = _cfg("deepspeed.offload=[optimizer]", "trainer.device=cpu")
    assert make_ds_config(cfg, d, "actor")["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_torch_adamw_is_fused_and_steps_as_the_textbook_formula():
    """Floating tensors on one device type get torch's fused AdamW; its steps equal AdamW (Loshchilov & Hutter
    2019, Algorithm 2) written out in float64."""
    import torch

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(7, 5))
    opt = OPTIMIZERS["torch_adamw"]([w], 1e-2, 0.1)
    assert opt.defaults["fused"] is True
    ref, m, v = w.detach().double().clone(), torch.zeros(7, 5, dtype=torch.float64), torch.zeros(7, 5, dtype=torch.float64)
    for t in range(1, 4):
        g = torch.randn(7, 5)
        w.grad = g.clone()
        opt.step()
        ref *= 1 - 1e-2 * 0.1  # decoupled weight decay
        m = 0.9 * m + 0.1 * g.double()
        v = 0.999 * v + 0.001 * g.double() ** 2
        ref -= 1e-2 * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(w.detach().double(), ref, atol=1e-6, rtol=1e-6)
    # parameters on a device fused AdamW does not run on: torch's default implementation
    assert OPTIMIZERS["torch_adamw"]([torch.nn.Parameter(torch.zeros(2, device="meta"))], 1e-2, 0.0).defaults["fused"] is None


@pytest.mark.parametrize("stage,world,role,reduce_scatter", [
    (3, 1, "actor", False), (3, 1, "critic", False), (3, 2, "actor", None), (3, 1, "ref", None), (2, 1, "actor", None)])
def test_zero3_on_one_rank_reduces_buckets_in_place(stage, world, role, reduce_scatter):
    """One rank: ZeRO-3 reduces its contiguous gradient buckets in place (no flatten and split per micro-batch);
    with more ranks DeepSpeed's reduce-scatter (half the bytes) stays; the frozen reference has no gradients."""
    cfg = load_config(None, [f"deepspeed.zero_stage={stage}", "rollout.batch_size=4", "actor.mini_batch_size=4",
                             "actor.micro_batch_size=2"])
    zero = make_ds_config(cfg, validate(cfg, world), role)["zero_optimization"]
    assert zero.get("reduce_scatter") is reduce_scatter
