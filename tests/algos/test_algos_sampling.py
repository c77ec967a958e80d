"""verl_ds.algos.sampling: DAPO overlong penalty, dynamic-sampling filter, pass@k and mean@k."""
from fractions import Fraction
from math import comb

import numpy as np
import pytest
import torch

from verl_ds.algos import groups_with_signal, mean_at_k, overlong_reward_penalty, pass_at_k


def _overlong_ref(length, l_max, buffer, factor):
    """DAPO eq. 13, piecewise, in float64."""
    if length <= l_max - buffer:
        return 0.0
    if length <= l_max:
        return factor * ((l_max - buffer) - length) / buffer
    return -factor


def test_overlong_penalty_hand_table():
    lengths = torch.tensor([0, 10, 11, 15, 19, 20, 25])
    out = overlong_reward_penalty(lengths, 20, 10)
    assert out.dtype == torch.float32 and out.shape == (7,)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.5, -0.9, -1.0, -1.0])
    assert not torch.signbit(out[:2]).any()  # a clean 0.0 below the ramp, not -0.0
    assert overlong_reward_penalty(lengths, 20, 10, 0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.05, -0.25, -0.45, -0.5, -0.5])
    assert overlong_reward_penalty(torch.tensor([20, 21]), 20, 0).tolist() == [0.0, -1.0]  # no buffer: a cliff


@pytest.mark.parametrize("l_max,buffer,factor", [(64, 16, 1.0), (30, 30, 2.0), (7, 3, 0.25)])
def test_overlong_penalty_matches_reference(l_max, buffer, factor):
    lengths = torch.arange(0, l_max + 5)
    expected = [_overlong_ref(int(n), l_max, buffer, factor) for n in lengths]
    torch.testing.assert_close(overlong_reward_penalty(lengths, l_max, buffer, factor).double(),
                               torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=1e-6)
    frac = torch.tensor([l_max - buffer + 0.5])  # float lengths work too
    assert overlong_reward_penalty(frac, l_max, buffer, factor).item() == pytest.approx(
        _overlong_ref(float(frac), l_max, buffer, factor))


def test_overlong_penalty_errors():
    ok = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"overlong_buffer \(9\) must be <= max_new_tokens \(8\)"):
        overlong_reward_penalty(ok, 8, 9)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        overlong_reward_penalty(ok, 0, 0)
    with pytest.raises(TypeError, match=r"overlong_buffer must be an int, got float \(2.5\)"):
        overlong_reward_penalty(ok, 8, 2.5)
    with pytest.raises(ValueError, match="response_length must be >= 0, got -3.0"):
        overlong_reward_penalty(torch.tensor([1, -3]), 8, 2)
    with pytest.raises(ValueError, match=r"response_length must be a \(B,\) integer or float tensor, .* "
                                         r"shape \(1, 2\)"):
        overlong_reward_penalty(ok[None], 8, 2)
    with pytest.raises(ValueError, match="penalty_factor must be a finite number >= 0, got -1.0"):
        overlong_reward_penalty(ok, 8, 2, -1.0)


def test_groups_with_signal_hand_and_loop():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.5, 0.5])
    ids = ["a", "a", "b", "b", "c", "d", "d"]
    # a: all equal; b: 0 vs 1; c: a group of one; d: all equal
    assert groups_with_signal(scores, ids).tolist() == [False, False, True, True, False, False, False]
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (40,), generator=g).double()
    ids = torch.randint(0, 12, (40,), generator=g)
    expected = [len({float(scores[j]) for j in range(40) if ids[j] == ids[i]}) > 1 for i in range(40)]
    assert groups_with_signal(scores, ids).tolist() == expected
    assert groups_with_signal(scores, ids.numpy()).tolist() == expected


def test_groups_with_signal_errors():
    with pytest.raises(ValueError, match="scores must be finite"):
        groups_with_signal(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\), got shape \(2, 1\)"):
        groups_with_signal(torch.zeros(2, 1), [0, 0])
    with pytest.raises(ValueError, match="group_index has 1 entries but there are 2 samples"):
        groups_with_signal(torch.zeros(2), [0])


def test_pass_at_k_against_exact_combinatorics():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(comb(n - c, k), comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)
    # large n: the binomials have hundreds of digits, the product form stays accurate
    for n, c, k in ((1000, 10, 100), (500, 1, 1), (2000, 3, 1000), (300, 299, 2)):
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-10)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0 and pass_at_k(np.int64(4), 2, 1) == 0.5


def test_mean_at_k_is_the_hypergeometric_mean():
    for n in range(1, 10):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # E[X / k], X = correct among k drawn without replacement
                exact = sum(Fraction(x, k) * comb(c, x) * comb(n - c, k - x) for x in range(k + 1)) / comb(n, k)
                assert mean_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert mean_at_k(8, 2, 1) == pass_at_k(8, 2, 1)


@pytest.mark.parametrize("args,exc,message", [
    ((3, 4, 1), ValueError, r"c \(correct samples\) must be <= n \(samples\), got c=4, n=3"),
    ((3, 1, 4), ValueError, r"k must be <= n \(samples drawn\), got k=4, n=3"),
    ((0, 0, 1), ValueError, "n must be >= 1, got 0"),
    ((3, 1, 0), ValueError, "k must be >= 1, got 0"),
    ((3.0, 1, 1), TypeError, r"n must be an int, got float \(3.0\)"),
    ((3, True, 1), TypeError, "c must be an int, got bool"),
])
def test_pass_and_mean_at_k_errors(args, exc, message):
    for fn in (pass_at_k, mean_at_k):
        with pytest.raises(exc, match=message):
            fn(*args)
