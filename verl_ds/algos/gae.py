"""Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over (B, R) rows with a response mask,
in verl's semantics (``compute_gae_advantage_return``): walking t backwards, a valid token does g <- r_t + gamma v -
V_t + gamma lam g and v <- V_t, a masked one changes neither (trailing padding bootstraps from 0, masked spans are
bridged); advantages = g after step t, returns = advantages + values. No Python loop over t: see ``_scan_compact``.
"""
from __future__ import annotations

import math

import torch

from ._checks import as_bool_mask, check_float_tensor, check_same_shape, check_unit_interval

# Rows per chunk so that the dozen (rows, T) temporaries stay in cache instead of faulting in fresh pages.
_CHUNK_ELEMS = 1 << 16
_TINY_LOG = math.log(1e-200)  # smallest weight kept in a block


def _block_len(c: float, t: int) -> int:
    if c >= 1.0 or t <= 1:
        return t
    if c <= 0.0:
        return 1
    if (t - 1) * math.log(c) >= _TINY_LOG:
        return t
    return max(1, int(_TINY_LOG / math.log(c)))


def _scan_compact(delta: torch.Tensor, c: float) -> torch.Tensor:
    """A_j = delta_j + c A_{j-1} along dim 1 of a (b, T) float64 tensor, in place: A_j = S_j / w_j, w_j = c**(J - j),
    S = cumsum(w delta). Earlier weights are smaller, so rounding stays ~eps max|delta| / (1 - c); blocks of L slots
    keep w >= 1e-200, each carrying in the previous block's last value (what that drops is below float64's grain)."""
    b, t = delta.shape
    blk = _block_len(c, t)
    if blk >= t:
        w = torch.pow(torch.full((t,), c, dtype=torch.float64, device=delta.device),
                      torch.arange(t - 1, -1, -1, dtype=torch.float64, device=delta.device))
        return delta.mul_(w).cumsum_(1).div_(w)
    nq = -(-t // blk)
    x = torch.nn.functional.pad(delta, (0, nq * blk - t)).view(b, nq, blk)  # (b, nq, L)
    w = torch.pow(torch.full((blk,), c, dtype=torch.float64, device=delta.device),
                  torch.arange(blk - 1, -1, -1, dtype=torch.float64, device=delta.device))
    x.mul_(w).cumsum_(2).div_(w)
    # carry from the previous block's last slot, decayed by c**(o + 1) at offset o
    decay = torch.pow(torch.full((blk,), c, dtype=torch.float64, device=delta.device),
                      torch.arange(1, blk + 1, dtype=torch.float64, device=delta.device))
    carry = x[:, :-1, -1:].clone()  # (b, nq - 1, 1)
    x[:, 1:].addcmul_(carry, decay)
    return x.view(b, nq * blk)[:, :t]


def _gae_rows(rewards, values, mask, gamma, lam, adv_out, ret_out):
    b, t = rewards.shape
    f64 = torch.float64
    mask_i = mask.to(torch.int64)
    # compact slot of position t: that of the next valid token at or after t, T-1 - (valid tokens before t)
    slot = torch.cumsum(mask_i, dim=1).sub_(mask_i).neg_().add_(t - 1)  # (b, T) int64
    dest = slot.masked_fill(~mask, t)  # masked tokens go to a spare column, so NaNs there never enter
    r_c = torch.zeros(b, t + 1, dtype=f64, device=rewards.device).scatter_(1, dest, rewards.to(f64))
    # v_c column j + 1 holds slot j; column 0 is the value 0 that follows the last valid token
    v_c = torch.zeros(b, t + 2, dtype=f64, device=values.device)
    v_c[:, 1:].scatter_(1, dest, values.to(f64))
    r_c[:, t] = 0.0
    # slot j: delta = r + gamma * V(next valid token, in slot j - 1) - V
    delta = torch.add(r_c[:, :t], v_c[:, :t], alpha=gamma).sub_(v_c[:, 1:t + 1])
    torch.gather(_scan_compact(delta, gamma * lam).to(torch.float32), 1, slot, out=adv_out)
    torch.add(adv_out, values, out=ret_out)


def compute_gae_torch(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                      gamma: float, lam: float):
    """Torch path of :func:`compute_gae` (no input checks), the Triton kernel's test reference."""
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    b, t = token_rewards.shape
    adv = torch.empty(b, t, dtype=torch.float32, device=token_rewards.device)
    ret = torch.empty(b, t, dtype=torch.float32, device=token_rewards.device)
    if t == 0 or b == 0:
        return adv, ret
    rows = max(1, _CHUNK_ELEMS // t) if token_rewards.device.type == "cpu" else b
    for s in range(0, b, rows):
        e = min(s + rows, b)
        _gae_rows(token_rewards[s:e], values[s:e], mask[s:e], float(gamma), float(lam), adv[s:e], ret[s:e])
    return adv, ret


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float = 1.0, lam: float = 1.0):
    """(advantages, returns) (B, R) float32 in verl's semantics; masked positions hold the carried advantage."""
    check_float_tensor(token_rewards, "token_rewards")
    check_float_tensor(values, "values")
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must have shape (B, R), got shape {tuple(token_rewards.shape)}")
    check_same_shape(token_rewards, "token_rewards", values, "values")
    mask = as_bool_mask(response_mask, "response_mask", token_rewards.shape, "token_rewards")
    gamma = check_unit_interval(gamma, "gamma")
    lam = check_unit_interval(lam, "lam")
    from verl_ds.kernels import dispatch

    if dispatch.backend_for(token_rewards) == "triton":
        from verl_ds.kernels.gae import compute_gae as kernel

        return kernel(token_rewards, values, mask, gamma, lam)
    return compute_gae_torch(token_rewards, values, mask, gamma, lam)
