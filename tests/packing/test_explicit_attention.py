"""Small attention calls without autograd computed explicitly (``varlen_attention._attend``): the numbers of a
float64 loop and of torch's sdpa, and which calls take that path."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import verl_ds.models.varlen_attention as va


class _Layer(torch.nn.Module):  # what sdpa_attention_forward reads off an attention module
    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def _loop_reference(q, k, v, mask, scaling):
    """float64, one query row at a time: softmax over the keys it may see (a bool mask) or of scores + mask (a
    float mask); a row that may see no key is 0. Query head h reads key/value head h // (heads / kv_heads)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, Lq, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                m = None if mask is None else mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1), i]
                scores = [float(q[b, h, i] @ k[b, h // g, j]) * scaling for j in range(k.shape[2])]
                if m is not None and m.dtype == torch.bool:
                    keys = [j for j in range(k.shape[2]) if m[j]]
                else:
                    keys = list(range(k.shape[2]))
                    if m is not None:
                        scores = [s + float(m[j]) for j, s in enumerate(scores)]
                if not keys:
                    continue
                top = max(scores[j] for j in keys)
                w = {j: math.exp(scores[j] - top) for j in keys}
                total = sum(w.values())
                out[b, i, h] = sum(w[j] / total * v[b, h // g, j] for j in keys)
    return out


def _case(B, H, Hkv, Lq, Lk, D, mask_kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h, L in ((H, Lq), (Hkv, Lk), (Hkv, Lk)))
    if mask_kind is None:
        return q, k, v, None
    keep = torch.rand(B, H if mask_kind.endswith("per_head") else 1, Lq, Lk, generator=gen) > 0.3
    keep[..., -1] = True
    if mask_kind == "bool_empty_row":
        keep[0, 0, 0] = False  # a query that may see nothing (a padded position)
    if mask_kind.startswith("float"):
        return q, k, v, torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    if mask_kind == "bool_batch1":
        keep = keep[:1]
    return q, k, v, keep


CASES = [  # B, heads, kv_heads, Lq, Lk, head dim, mask
    (3, 8, 4, 1, 11, 16, "bool"),  # a decoding step, grouped-query attention
    (2, 4, 4, 5, 5, 8, "bool_empty_row"),  # a padded prefill
    (2, 6, 2, 7, 9, 8, "float"),
    (2, 4, 2, 3, 6, 8, "bool_batch1"),  # one mask for the whole batch
    (2, 4, 1, 1, 7, 8, None),  # one query, no mask: every key
    (2, 8, 4, 3, 5, 8, "bool_per_head"),  # a mask per query head
    (2, 8, 2, 3, 5, 8, "float_per_head"),
]


@pytest.mark.parametrize("B, H, Hkv, Lq, Lk, D, mask_kind", CASES)
def test_explicit_attention_matches_a_float64_loop_and_sdpa(B, H, Hkv, Lq, Lk, D, mask_kind):
    q, k, v, mask = _case(B, H, Hkv, Lq, Lk, D, mask_kind)
    layer = _Layer(H, Hkv)
    with torch.no_grad():
        got, _ = va._attend(layer, q, k, v, mask, scaling=0.3, is_causal=False)
        sdpa, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3, is_causal=False)
    assert got.shape == (B, Lq, H, D) and got.is_contiguous()
    torch.testing.assert_close(got.double(), _loop_reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)
    if mask_kind == "bool_empty_row":
        assert got[0, 0].abs().max() == 0  # as sdpa: nothing to attend gives 0


def test_default_scaling_is_one_over_sqrt_head_dim():
    q, k, v, mask = _case(2, 4, 2, 3, 5, 16, "bool")
    with torch.no_grad():
        got, _ = va._attend(_Layer(4, 2), q, k, v, mask, is_causal=False)
    torch.testing.assert_close(got.double(), _loop_reference(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


def _flash_calls(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if "scaled_dot_product" in e.key)


def test_only_small_calls_without_autograd_are_explicit(monkeypatch):
    q, k, v, mask = _case(2, 4, 2, 6, 6, 8, "bool")
    layer = _Layer(4, 2)
    call = lambda: va._attend(layer, q, k, v, mask, is_causal=False)  # noqa: E731
    with torch.no_grad():
        assert _flash_calls(call) == 0
        monkeypatch.setattr(va, "EXPLICIT_MAX_SCORES", 2 * 4 * 6 * 6 - 1)  # one score over the limit
        assert _flash_calls(call) > 0
        monkeypatch.undo()
        # causal without a mask (a packed sequence) is sdpa's is_causal
        assert _flash_calls(lambda: va._attend(layer, q, k, v, None, is_causal=True)) > 0
    q.requires_grad_(True)
    assert _flash_calls(call) > 0  # the update's forward: sdpa, whose backward is the faster one
    with torch.no_grad():
        assert _flash_calls(call) == 0
