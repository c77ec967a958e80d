"""verl_ds.algos._parallel: the threaded row loop behind the chunked CPU paths."""
import pytest
import torch

from verl_ds.algos import compute_gae, full_symmetric_kl, logprobs_and_entropy
from verl_ds.algos._parallel import as_row_blocks, chunk_plan, chunk_rows_of, run_ranges
from verl_ds.algos.logprob import logprobs_and_entropy_torch


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_ranges_cover_every_item_once(two_threads):
    seen = []
    run_ranges(23, lambda lo, hi: seen.append((lo, hi)), torch.device("cpu"))
    assert len(seen) == 2
    assert sorted(r for lo, hi in seen for r in range(lo, hi)) == list(range(23))
    assert torch.get_num_threads() == 2  # restored


def test_chunk_plan_over_flat_rows_and_row_blocks():
    x = torch.zeros(3, 10, 4)[:, 1:8]  # (3, 7, 4) slice: its rows cannot be flattened without a copy
    blocks = as_row_blocks(x)
    assert blocks.shape == (3, 7, 4) and blocks.data_ptr() == x.data_ptr()
    plan = chunk_plan(blocks, 3)
    assert [c[3] for c in plan] == [0, 3, 6, 7, 10, 13, 14, 17, 20]
    assert sum(chunk_rows_of(blocks, c).shape[0] for c in plan) == 21
    flat = as_row_blocks(torch.zeros(3, 7, 4))
    assert flat.shape == (21, 4) and [c[1:] for c in chunk_plan(flat, 8)] == [(0, 8, 0), (8, 16, 8), (16, 21, 16)]


def test_worker_errors_propagate_and_threads_are_restored(two_threads):
    def work(lo, hi):
        if lo > 0:
            raise RuntimeError(f"boom at {lo}")
    with pytest.raises(RuntimeError, match="boom at"):
        run_ranges(8, work, torch.device("cpu"))
    assert torch.get_num_threads() == 2


def test_same_results_with_one_and_two_threads(two_threads):
    logits, labels = torch.randn(37, 301), torch.randint(0, 301, (37,))
    x2 = logits.clone().requires_grad_()
    lp2, h2 = logprobs_and_entropy_torch(x2, labels, 0.9, chunk_rows=3)
    (lp2.sum() + h2.sum()).backward()
    torch.set_num_threads(1)
    x1 = logits.clone().requires_grad_()
    lp1, h1 = logprobs_and_entropy_torch(x1, labels, 0.9, chunk_rows=3)
    (lp1.sum() + h1.sum()).backward()
    assert torch.equal(lp1, lp2) and torch.equal(h1, h2) and torch.equal(x1.grad, x2.grad)


def test_inference_mode_and_no_grad_callers(two_threads):
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
