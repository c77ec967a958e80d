"""Masked GAE over (B, T) in verl's semantics as an associative scan (torch twin: ``verl_ds.algos.gae``): a GPU
reads each row once in O(log BLOCK_T) dependent steps per chunk, where a reverse loop pays T memory latencies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_runnable

# Longest chunk the scan holds at once: 2048 steps keep it in registers (8 warps x 32 lanes x 8
# values per tensor); longer rows loop over chunks with a carry. A module constant so tests can
# shrink it to exercise the carry.
SCAN_BLOCK_T_MAX = 2048


@triton.jit
def _affine_combine(a1, b1, a2, b2):
    # (a1, b1) is the earlier map in scan order (later in time), applied first.
    return a1 * a2, b1 * a2 + b2


# Each step is the affine map g <- a g + b: a = gamma lam, b = r_t + gamma v+_t - V_t where mask_t, else a = 1, b = 0,
# with v+_t the value at the first valid position after t, itself a scan of v <- (mask ? V : v). Applying (a1, b1)
# then (a2, b2) is (a1 a2, b1 a2 + b2), associative. The row is read in reverse time order with a forward scan
# (reverse=True with a non-commutative combine was unreliable on GPU, triton #4362), in chunks whose carry (v+, g)
# passes to the next-earlier chunk.
@triton.jit
def _gae_scan_kernel(
    rewards_ptr, values_ptr, mask_ptr, adv_ptr, ret_ptr, n_steps,
    rewards_stride, values_stride, mask_stride, out_stride, gamma, gamma_lam, BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r_row = rewards_ptr + row * rewards_stride
    v_row = values_ptr + row * values_stride
    m_row = mask_ptr + row * mask_stride
    i = tl.arange(0, BLOCK_T)
    v_carry = tl.zeros((), tl.float32)  # v+ just after this chunk (first valid value later in time)
    g_carry = tl.zeros((), tl.float32)  # the advantage carried in from later in time
    for start in range(0, n_steps, BLOCK_T):
        # 1. Scan index i is time t = T-1-start-i (the chunk read backwards); t < 0 is an identity map.
        t = n_steps - 1 - start - i
        ok = t >= 0
        # 2. v+_t: scan over position t+1 (the element after t), then apply it to the carry.
        ok_next = ok & (t + 1 < n_steps)
        m_next = tl.load(m_row + t + 1, mask=ok_next, other=0) != 0
        v_after = tl.load(v_row + t + 1, mask=ok_next & m_next, other=0.0).to(tl.float32)
        a_v, b_v = tl.associative_scan((tl.where(m_next, 0.0, 1.0), v_after), 0, _affine_combine)
        v_plus = a_v * v_carry + b_v
        # 3. The advantage maps, scanned and applied to the carried g.
        m = tl.load(m_row + t, mask=ok, other=0) != 0
        r = tl.load(r_row + t, mask=ok & m, other=0.0).to(tl.float32)
        v = tl.load(v_row + t, mask=ok, other=0.0).to(tl.float32)
        a_g = tl.where(m, gamma_lam, 1.0)
        b_g = tl.where(m, r + gamma * v_plus - v, 0.0)
        a_g, b_g = tl.associative_scan((a_g, b_g), 0, _affine_combine)
        g = a_g * g_carry + b_g
        tl.store(adv_ptr + row * out_stride + t, g, mask=ok)
        tl.store(ret_ptr + row * out_stride + t, g + v, mask=ok)
        # 4. The earliest element of the chunk carries both into the next (earlier) chunk.
        last = i == BLOCK_T - 1
        v_carry = tl.sum(tl.where(last, v_plus, 0.0), 0)
        g_carry = tl.sum(tl.where(last, g, 0.0), 0)


def _check_inputs(token_rewards, values, response_mask, gamma, lam):
    for name, t in (("token_rewards", token_rewards), ("values", values), ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("token_rewards", token_rewards), ("values", values)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if response_mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be bool, got {response_mask.dtype}")
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D (B, T), got shape {tuple(token_rewards.shape)}")
    for name, t in (("values", values), ("response_mask", response_mask)):
        if t.shape != token_rewards.shape:
            raise ValueError(
                f"{name} must have token_rewards' shape {tuple(token_rewards.shape)}, got {tuple(t.shape)}")
        if t.device != token_rewards.device:
            raise ValueError(f"{name} must be on token_rewards' device {token_rewards.device}, got {t.device}")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x:
            raise TypeError(f"{name} must be a real number, got {x!r}")


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float, lam: float):
    """Masked GAE with the Triton kernel, no gradient: (advantages, returns) (B, T) float32; a bool mask."""
    _check_inputs(token_rewards, values, response_mask, gamma, lam)
    check_runnable(token_rewards, "compute_gae")
    n_rows, n_steps = token_rewards.shape
    rewards = token_rewards.detach()
    vals = values.detach()
    rewards = rewards if rewards.stride(-1) == 1 else rewards.contiguous()
    vals = vals if vals.stride(-1) == 1 else vals.contiguous()
    mask = (response_mask if response_mask.stride(-1) == 1 else response_mask.contiguous()).view(torch.uint8)
    advantages = torch.empty(n_rows, n_steps, dtype=torch.float32, device=token_rewards.device)
    returns = torch.empty_like(advantages)
    if advantages.numel() == 0:
        return advantages, returns
    args = (rewards, vals, mask, advantages, returns)
    strides = (rewards.stride(0), vals.stride(0), mask.stride(0), advantages.stride(0),
               float(gamma), float(gamma) * float(lam))
    block_t = max(16, min(triton.next_power_of_2(n_steps), SCAN_BLOCK_T_MAX))
    _gae_scan_kernel[(n_rows,)](*args, n_steps, *strides, BLOCK_T=block_t, num_warps=max(1, min(8, block_t // 256)))
    return advantages, returns
