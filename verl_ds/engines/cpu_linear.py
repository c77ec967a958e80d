"""Linear layers of float32 CPU models on oneDNN (``model.cpu_linear``).

On a CPU, ``torch.nn.functional.linear`` runs its float32 products through the BLAS torch was built with (MKL in
the x86 wheels). On AMD processors MKL takes its AVX2 code path (a profile of a step here spends its products in
``mkl_blas_def_sgemm_kernel_0_zen``) while oneDNN, which the same wheels carry for their CPU kernels, picks its
kernels by instruction set (AVX-512 where there is AVX-512). On a 2-core AMD EPYC with AVX-512 the products of the
30M-parameter benchmark model's layers (8 layers, 128-563 tokens, weights cold as in a real pass) run 10-15%
faster through oneDNN (``benchmarks/cpu_linear.py``) and its whole GRPO step 3-9% faster (``benchmarks/e2e_vs_trl.py
--verl-ds-variant 'torch linear:model.cpu_linear=torch'``, interleaved runs).

What runs where, with ``onednn``:
- every forward of a converted Linear, and the backward's input gradient dx = dy W, go through oneDNN's inner-product
  primitive (``torch.ops.mkldnn._linear_pointwise``, the op torch's own inductor emits for CPU linears; it has no
  autograd of its own, so the backward is written here);
- the weight gradient dy^T x stays a torch product (oneDNN was no faster at it), so gradients reach ``.grad`` as
  autograd's do and DeepSpeed's hooks see them as before; ``GradAccumLinear`` (ZeRO-0) keeps adding its product
  into ``.grad``.
The sums are those of any float32 GEMM, in another order: outputs differ from MKL's in the last bits.
Anything else (a product under ``MIN_MACS`` multiply-adds, another dtype or device, a 1-D weight, CPU autocast on)
takes ``F.linear``.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHOICES = ("auto", "onednn", "torch")
# oneDNN costs some 20 us more per call than MKL (its primitive lookup): products under 2^24 multiply-adds
# (tokens x in x out; a 140-token micro-batch of a 512 x 256 projection is 18M) stay on F.linear, where that is
# more than oneDNN gains (benchmarks/cpu_linear.py: 2-4x slower on the default tiny model's products)
MIN_MACS = 1 << 24
# a Linear is put on oneDNN only if a call of this many tokens would reach MIN_MACS: the smaller ones (a tiny
# model's, an LM head over a small vocabulary) keep torch's own Linear and its per-call cost
CONVERT_MIN_TOKENS = 1024

__all__ = ["CHOICES", "CONVERT_MIN_TOKENS", "MIN_MACS", "OneDNNLinear", "linear", "linear_input_grad",
           "onednn_available", "resolve_cpu_linear", "use_onednn_linears", "uses_onednn"]


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's CPU inner product (``torch.ops.mkldnn._linear_pointwise`` with a CPU
    kernel); a lookup, nothing runs (oneDNN starts only when a product first takes it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the lookup raises where the op does not exist)
    except (AttributeError, RuntimeError):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("mkldnn::_linear_pointwise", "CPU")


def _cpu_vendor() -> str:
    """The x86 vendor string of this machine ("AuthenticAMD", "GenuineIntel"), "" when unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def resolve_cpu_linear(setting: str) -> str:
    """``model.cpu_linear`` as the backend CPU float32 Linears use: "onednn" or "torch". ``auto`` is oneDNN on AMD
    CPUs with AVX-512, where it was measured faster than MKL, and torch elsewhere; ``onednn`` on a torch without
    oneDNN is an error."""
    if setting not in CHOICES:
        raise ValueError(f"model.cpu_linear must be one of {CHOICES}; got {setting!r}")
    if setting == "onednn" and not onednn_available():
        raise ValueError("model.cpu_linear=onednn, but this torch build has no oneDNN inner product "
                         "(torch.ops.mkldnn._linear_pointwise); use auto or torch")
    if setting != "auto":
        return setting
    amd_avx512 = _cpu_vendor() == "AuthenticAMD" and torch.backends.cpu.get_cpu_capability() == "AVX512"
    return "onednn" if amd_avx512 and onednn_available() else "torch"


def _on_onednn(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    # the size first: most calls that fail, fail there, and cheaply
    return (weight.dim() == 2 and x.numel() * weight.shape[0] >= MIN_MACS and x.dim() >= 1
            and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x W^T + b (``F.linear``'s contract, (..., in) -> (..., out)) through oneDNN when x is a float32 CPU tensor
    and the product has at least ``MIN_MACS`` multiply-adds, else ``F.linear``. Not differentiable on the oneDNN
    path: call it under no_grad or from an autograd Function."""
    if _on_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dy W, the input gradient of ``linear`` ((..., out) -> (..., in)), on the same backend."""
    return linear(dy, weight.t())


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x W^T + b on oneDNN; the backward gives dx on oneDNN and dW = dy^T x, db = sum(dy) as autograd does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = linear_input_grad(dy, weight) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
            if ctx.needs_input_grad[1]:
                dw = dy2.t() @ x.reshape(-1, x.shape[-1])  # (out, in)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2.sum(0)
        return dx, dw, db


class OneDNNLinear(torch.nn.Linear):
    """``torch.nn.Linear`` on oneDNN (module docstring): the same parameters, state dict and gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def use_onednn_linears(module: torch.nn.Module) -> int:
    """Put every plain ``torch.nn.Linear`` of ``module`` on oneDNN (``OneDNNLinear``, the same objects and
    parameters) and every ``GradAccumLinear`` too, except layers whose products stay under ``MIN_MACS`` even at
    ``CONVERT_MIN_TOKENS`` tokens; returns how many. Subclasses of Linear that others own (peft's LoRA layers wrap a
    plain base Linear, which is converted) are left as they are."""
    from verl_ds.engines.grad_accum import GradAccumLinear

    count = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.in_features * m.out_features * CONVERT_MIN_TOKENS < MIN_MACS:
            continue
        if type(m) is torch.nn.Linear:
            m.__class__ = OneDNNLinear  # optimizer state, hooks and checkpoints see the same parameters
            count += 1
        elif type(m) is GradAccumLinear:
            m.onednn = True
            count += 1
    return count


def uses_onednn(module: torch.nn.Module) -> bool:
    """Whether any Linear of ``module`` runs on oneDNN (a replica built from it then should too)."""
    return any(type(m) is OneDNNLinear or getattr(m, "onednn", False) is True for m in module.modules())


def log_choice(setting: str, backend: str) -> None:
    """One line saying which backend CPU float32 Linears use and why (once per process and setting)."""
    _log_once(setting, backend, _cpu_vendor() or "unknown vendor", torch.backends.cpu.get_cpu_capability(),
              os.cpu_count())


@functools.lru_cache(maxsize=None)
def _log_once(setting, backend, vendor, capability, cpus) -> None:
    log.info("CPU float32 Linear layers on %s (model.cpu_linear=%s; %s, %s, %s CPUs)", backend, setting, vendor,
             capability, cpus)
