"""Weight gradients accumulated inside the matrix product, as Megatron-LM's ``--gradient-accumulation-fusion``
(Narayanan et al. 2021, https://arxiv.org/abs/2104.04473; https://github.com/NVIDIA/Megatron-LM).

With gradient accumulation autograd computes each Linear's weight gradient dy^T x of a micro-batch into a fresh
tensor, and AccumulateGrad then adds it to ``weight.grad``: per weight and micro-batch, a whole gradient written,
both read and one written back (and on a CPU a fresh tensor's pages faulted in). ``GradAccumLinear`` does it in one
``addmm_`` into ``weight.grad``: the same sum (the product is added to the gradient once, as AccumulateGrad adds
it), one pass over the gradient.

The weight's AccumulateGrad node then never runs, so nothing that hooks it sees the gradient arrive: ZeRO stages 1-3
(they reduce or partition each gradient as it arrives) and DeepSpeed's fp16/bf16 optimizers (they copy it to fp32)
would miss it. ``fuse_grad_accumulation(engine)`` therefore applies only to a ZeRO-0 engine whose optimizer is a
plain torch optimizer (fp32), and leaves a weight with post-accumulate-grad hooks alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_ds.engines import cpu_linear

__all__ = ["GradAccumLinear", "fuse_grad_accumulation", "can_fuse_grad_accumulation"]


def _add_product(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad += a @ b, the product written into the gradient (a fresh one for the first micro-batch)."""
    if param.grad is None:
        param.grad = a @ b
    else:
        param.grad.addmm_(a, b)


class _LinearGradAccum(torch.autograd.Function):
    """y = x W^T + b whose backward returns dx only and adds dW (and db) straight into the parameters' .grad;
    ``onednn``: the forward and dx on oneDNN (``verl_ds.engines.cpu_linear``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, onednn=False):
        ctx.save_for_backward(x, weight)
        # the parameters themselves, for their .grad: a saved tensor unpacks as another tensor object under
        # activation checkpointing (torch.utils.checkpoint's saved-tensor hooks), and a .grad set on it is lost
        ctx.weight, ctx.bias, ctx.onednn = weight, bias, onednn
        return cpu_linear.linear(x, weight, bias) if onednn else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            dx = None
        else:
            dx = cpu_linear.linear_input_grad(dy, weight) if ctx.onednn else dy @ weight
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        _add_product(ctx.weight, dy2.t(), x2)
        bias = ctx.bias
        if bias is not None and bias.requires_grad:
            if bias.grad is None:
                bias.grad = dy2.sum(0)
            else:
                bias.grad.add_(dy2.sum(0))
        return dx, None, None, None


class GradAccumLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose trainable weight's gradient accumulates inside the product (module docstring); the
    same parameters and state dict. Without grad, or with a frozen weight, it is ``F.linear``. ``onednn`` (set by
    ``cpu_linear.use_onednn_linears``): its forward and input gradient run on oneDNN."""

    onednn = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _LinearGradAccum.apply(x, self.weight, self.bias, self.onednn)
        return cpu_linear.linear(x, self.weight, self.bias) if self.onednn else F.linear(x, self.weight, self.bias)


def can_fuse_grad_accumulation(engine) -> bool:
    """Whether nothing but ``.grad`` receives ``engine``'s gradients: ZeRO stage 0 with a plain torch optimizer."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    return stage == 0 and isinstance(getattr(engine, "optimizer", None), torch.optim.Optimizer)


def fuse_grad_accumulation(module_or_engine) -> int:
    """Turn every plain ``torch.nn.Linear`` (or ``OneDNNLinear``, which stays on oneDNN) with a trainable weight (and
    no post-accumulate-grad hooks) of a module, or of a DeepSpeed engine that ``can_fuse_grad_accumulation``, into
    ``GradAccumLinear``; returns how many. Other engines are left as they are (0)."""
    module = module_or_engine
    if hasattr(module_or_engine, "zero_optimization_stage"):
        if not can_fuse_grad_accumulation(module_or_engine):
            return 0
        module = module_or_engine.module
    count = 0
    for m in module.modules():
        linear = type(m) in (torch.nn.Linear, cpu_linear.OneDNNLinear)
        hooks = getattr(m.weight, "_post_accumulate_grad_hooks", None) if linear else None
        if linear and m.weight.requires_grad and not hooks:
            onednn = type(m) is cpu_linear.OneDNNLinear
            m.__class__ = GradAccumLinear  # the same object and parameters: optimizer and checkpoints are unaffected
            if onednn:
                m.onednn = True  # keeps its backend
            count += 1
    return count
