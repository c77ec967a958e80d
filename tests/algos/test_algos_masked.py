"""verl_ds.algos masked statistics and loss aggregation."""
import pytest
import torch
from algos_refs import masked_stats_loop

from verl_ds.algos import LOSS_AGG_MODES, agg_loss, masked_mean, masked_var, masked_whiten


def test_masked_mean_var_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -5.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert masked_mean(x, m).item() == pytest.approx(2.5)
    assert masked_var(x, m).item() == pytest.approx(5.0 / 3.0)  # (2.25+0.25+0.25+2.25)/3
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, m, dim=0), torch.tensor([2.5, 2.0, 3.0]))


def test_against_loop_with_nan_in_padding():
    x = torch.randn(5, 17)
    m = torch.rand(5, 17) > 0.4
    mean_ref, var_ref = masked_stats_loop(x, m)
    x_bad = x.masked_fill(~m, float("nan"))
    assert masked_mean(x_bad, m).item() == pytest.approx(mean_ref, abs=1e-6)
    assert masked_var(x_bad, m).item() == pytest.approx(var_ref, rel=1e-5)
    w = masked_whiten(x_bad, m)
    assert torch.isfinite(w).all() and torch.equal(w[~m], torch.zeros(int((~m).sum())))
    expected = (x[m].double() - mean_ref) / (var_ref + 1e-8) ** 0.5
    torch.testing.assert_close(w[m].double(), expected, atol=1e-5, rtol=1e-5)
    w2 = masked_whiten(x_bad, m, shift_mean=False)
    torch.testing.assert_close(w2[m].double(), expected + mean_ref, atol=1e-5, rtol=1e-5)
    # whitened values have mean 0 and unbiased variance ~1 over the mask
    assert masked_mean(w, m).abs().item() < 1e-6
    assert masked_var(w, m).item() == pytest.approx(1.0, rel=1e-5)


def test_gradients_ignore_nan_padding():
    x = torch.randn(3, 6).masked_fill(torch.eye(3, 6, dtype=torch.bool), float("nan")).requires_grad_()
    m = ~torch.eye(3, 6, dtype=torch.bool)
    (masked_mean(x, m) + masked_var(x, m) + masked_whiten(x, m).square().sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[~m], torch.zeros(3))


def test_masked_mean_with_nothing_valid_is_zero():
    x = torch.randn(2, 3)
    m = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, m).item() == 0.0
    m[0] = True
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.stack([x[0].mean(), torch.tensor(0.0)]))


def test_fewer_than_two_valid_elements_is_an_error():
    x = torch.randn(2, 3)
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    with pytest.raises(ValueError, match=r"masked_var needs at least 2 valid \(mask=True\) elements for the "
                                         r"unbiased variance, got 1"):
        masked_var(x, one)
    with pytest.raises(ValueError, match=r"masked_whiten needs at least 2 valid \(mask=True\) elements .* got 0"):
        masked_whiten(x, torch.zeros(2, 3))
    assert masked_var(x, one, unbiased=False).item() == 0.0


def test_mask_errors_name_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"mask must hold only 0 and 1 \(or be a bool tensor\), got a value 2"):
        masked_mean(x, torch.full((2, 3), 2))
    with pytest.raises(ValueError, match=r"shape mismatch: mask has shape \(3, 2\) but x has shape \(2, 3\)"):
        masked_var(x, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        masked_whiten(x, [[1, 1, 1], [1, 1, 1]])
    # 0/1 floats and ints are fine
    assert masked_mean(x, torch.ones(2, 3)).item() == pytest.approx(x.mean().item(), abs=1e-6)
    assert masked_mean(x, torch.ones(2, 3, dtype=torch.long)).item() == pytest.approx(x.mean().item(), abs=1e-6)


# --- agg_loss ---------------------------------------------------------------------------------------

def _agg_ref(x, m, mode, normalizer=None, max_len=None):
    rows = [[float(v) for v, k in zip(xr, mr) if k] for xr, mr in zip(x.tolist(), m.tolist())]
    n_tok = sum(len(r) for r in rows)
    n_seq = sum(1 for r in rows if r)
    total = sum(sum(r) for r in rows)
    if mode == "token-mean":
        return total / (normalizer if normalizer is not None else max(n_tok, 1))
    denom = normalizer if normalizer is not None else max(n_seq, 1)
    if mode == "seq-mean-token-sum":
        return total / denom
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / denom
    return total / (denom * (max_len or x.shape[1]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_modes_against_definition(mode):
    x = torch.randn(5, 9)
    m = torch.rand(5, 9) > 0.4
    m[2] = False  # an all-masked sequence does not count
    m[0] = True
    x_bad = x.masked_fill(~m, float("nan"))
    out = agg_loss(x_bad, m, mode)
    assert out.dim() == 0 and out.dtype == torch.float32
    assert out.item() == pytest.approx(_agg_ref(x, m, mode), rel=1e-5, abs=1e-6)
    assert agg_loss(x_bad, m, mode, normalizer=7.5).item() == pytest.approx(_agg_ref(x, m, mode, 7.5), rel=1e-5)
    assert agg_loss(x_bad, m, mode, normalizer=torch.tensor(3.0)).item() == pytest.approx(
        _agg_ref(x, m, mode, 3.0), rel=1e-5)


def test_agg_loss_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(x, m, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(10 / 2)
    assert agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert agg_loss(x, m, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(10 / (2 * 5))
    assert agg_loss(x, torch.zeros(3, 3), "token-mean").item() == 0.0


def test_normalizer_gives_the_global_token_mean_across_micro_batches():
    # two ranks x two micro-batches: each passes N_global / (dp * gas); DeepSpeed averages the four losses
    x = torch.randn(4, 3, 8)
    m = torch.rand(4, 3, 8) > 0.5
    m[:, 0, 0] = True
    global_mean = x[m].sum() / m.sum()
    per_micro = [agg_loss(x[i], m[i], "token-mean", normalizer=m.sum().float() / 4) for i in range(4)]
    torch.testing.assert_close(torch.stack(per_micro).mean(), global_mean)


def test_agg_loss_gradient_and_errors():
    x = torch.randn(2, 4, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    agg_loss(x, m, "token-mean").backward()
    torch.testing.assert_close(x.grad, m.float() / 6)
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'seq-mean'; valid modes: token-mean, "
                                         r"seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"):
        agg_loss(x, m, "seq-mean")
    with pytest.raises(ValueError, match=r"shape mismatch: response_mask has shape \(2, 3\) but loss_mat has shape \(2, 4\)"):
        agg_loss(x, m[:, :3], "token-mean")
    with pytest.raises(ValueError, match=r"loss_mat must have shape \(B, R\), got shape \(8,\)"):
        agg_loss(x.view(8), m.view(8), "token-mean")
    with pytest.raises(ValueError, match="normalizer must be a positive number or a 0-d tensor, got 0"):
        agg_loss(x, m, "token-mean", normalizer=0)
    with pytest.raises(ValueError, match=r"normalizer must be a number or a 0-d tensor, got a tensor of shape \(2,\)"):
        agg_loss(x, m, "token-mean", normalizer=torch.ones(2))
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        agg_loss(x, m.float() * 0.5, "token-mean")
