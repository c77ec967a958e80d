"""verl_ds.algos._chunks: the chunk plan behind the torch paths over (N, V) rows and (B, T, V) row blocks."""
import torch

from verl_ds.algos import compute_gae, full_symmetric_kl, logprobs_and_entropy
from verl_ds.algos._chunks import as_row_blocks, chunk_plan, chunk_rows_of


def test_chunk_plan_over_flat_rows_and_row_blocks():
    x = torch.zeros(3, 10, 4)[:, 1:8]  # (3, 7, 4) slice: its rows cannot be flattened without a copy
    blocks = as_row_blocks(x)
    assert blocks.shape == (3, 7, 4) and blocks.data_ptr() == x.data_ptr()
    plan = chunk_plan(blocks, 3)
    assert [c[3] for c in plan] == [0, 3, 6, 7, 10, 13, 14, 17, 20]
    assert sum(chunk_rows_of(blocks, c).shape[0] for c in plan) == 21
    flat = as_row_blocks(torch.zeros(3, 7, 4))
    assert flat.shape == (21, 4) and [c[1:] for c in chunk_plan(flat, 8)] == [(0, 8, 0), (8, 16, 8), (16, 21, 16)]


def test_inference_mode_and_no_grad_callers():
    logits, labels = torch.randn(64, 5000), torch.randint(0, 5000, (64,))
    ref = logprobs_and_entropy(logits, labels)
    with torch.inference_mode():
        out = logprobs_and_entropy(logits, labels)
        kl = full_symmetric_kl(logits, logits.flip(0))
        adv, _ = compute_gae(torch.randn(64, 3000), torch.randn(64, 3000), torch.ones(64, 3000, dtype=torch.bool))
    with torch.no_grad():
        out2 = logprobs_and_entropy(logits, labels)
    for a, b, c in zip(ref, out, out2):
        assert torch.equal(a.detach(), b) and torch.equal(b, c)
    assert kl.shape == (64,) and adv.shape == (64, 3000)
