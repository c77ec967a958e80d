"""verl_ds.algos KL controllers: a KL series in, the coefficient series out."""
import math

import pytest
import torch

from verl_ds.algos import (
    BandKLController,
    FixedKLController,
    ZieglerKLController,
    make_kl_controller,
    observed_kl,
)


def _run(ctrl, kls, n=None):
    return [ctrl.update(kl, n) for kl in kls]


def test_band_sequence_by_hand():
    ctrl = BandKLController(0.1, target_kl=0.02)
    # band: > 0.03 raises x1.5, < 0.01 lowers x0.8, otherwise unchanged
    kls = [0.05, 0.05, 0.02, 0.0301, 0.03, 0.01, 0.0099, 0.0, 0.02]
    expected, coef = [], 0.1
    for factor in (1.5, 1.5, 1.0, 1.5, 1.0, 1.0, 0.8, 0.8, 1.0):
        coef *= factor
        expected.append(coef)
    assert _run(ctrl, kls) == pytest.approx(expected, rel=1e-12)
    assert ctrl.value == pytest.approx(expected[-1])


def test_band_clamps_and_custom_factors():
    ctrl = BandKLController(0.1, 1.0, up=2.0, down=0.5, min_coef=0.02, max_coef=0.5)
    assert _run(ctrl, [10, 10, 10, 10]) == pytest.approx([0.2, 0.4, 0.5, 0.5])
    assert _run(ctrl, [0, 0, 0, 0, 0]) == pytest.approx([0.25, 0.125, 0.0625, 0.03125, 0.02])


def test_ziegler_sequence():
    ctrl = ZieglerKLController(0.2, target_kl=6.0, horizon=10000)
    kls = [6.0, 9.0, 3.0, 12.0, 0.0, 6.6]
    n = 256
    coef, expected = 0.2, []
    for kl in kls:
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        coef *= 1 + err * n / 10000
        expected.append(coef)
    assert _run(ctrl, kls, n) == pytest.approx(expected, rel=1e-12)
    # the step is +-0.2 n / H at most: 0.2 * (1 + 0.2 * 256 / 1e4) after a KL far above target
    ctrl = ZieglerKLController(0.2, 6.0, 10000)
    assert ctrl.update(1e6, 256) == pytest.approx(0.2 * (1 + 0.2 * 0.0256))


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    assert _run(ctrl, [0.0, 1.0, 100.0], 8) == [0.05, 0.05, 0.05]


@pytest.mark.parametrize("kind,kwargs", [("fixed", {}), ("ziegler", {}), ("band", {}), ("band", {"up": 1.2}),
                                         ("band", {"down": 0.5})])
def test_state_dict_round_trip_resumes_exactly(kind, kwargs):
    a = make_kl_controller(kind, 0.1, 0.05, horizon=500, **kwargs)
    _run(a, [0.2, 0.01, 0.08], 64)
    b = make_kl_controller(kind, 0.7, 0.3, horizon=9, **kwargs)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert _run(a, [0.3, 0.001], 64) == _run(b, [0.3, 0.001], 64)


def test_factory_kinds_and_tensor_inputs():
    assert isinstance(make_kl_controller("fixed", 0.1, None), FixedKLController)
    assert isinstance(make_kl_controller("ziegler", 0.1, 0.05), ZieglerKLController)
    m = make_kl_controller("band", 0.1, 0.05, min_coef=0.01)
    assert isinstance(m, BandKLController) and m.min_coef == 0.01
    assert m.update(torch.tensor(1.0), 4) == pytest.approx(0.15)  # a 0-d tensor KL is accepted


def test_controller_errors():
    with pytest.raises(ValueError, match=r"unknown KL controller kind 'pid'; valid kinds: fixed, ziegler, band;"):
        make_kl_controller("pid", 0.1, 0.05)
    with pytest.raises(ValueError, match="the ziegler KL controller needs target_kl"):
        make_kl_controller("ziegler", 0.1)
    with pytest.raises(ValueError, match="the band KL controller needs target_kl"):
        make_kl_controller("band", 0.1)
    with pytest.raises(TypeError, match="unexpected arguments for the 'ziegler' KL controller: up"):
        make_kl_controller("ziegler", 0.1, 0.05, up=2.0)
    with pytest.raises(ValueError, match="target_kl must be > 0, got 0.0"):
        BandKLController(0.1, 0.0)
    with pytest.raises(ValueError, match="init_kl_coef must be >= 0, got -0.1"):
        ZieglerKLController(-0.1, 0.05)
    with pytest.raises(ValueError, match="up must be >= 1"):
        BandKLController(0.1, 0.05, up=0.9)
    with pytest.raises(ValueError, match=r"init_kl_coef must be in \[min_coef, max_coef\]"):
        BandKLController(0.1, 0.05, min_coef=0.2)
    ctrl = ZieglerKLController(0.1, 0.05)
    with pytest.raises(ValueError, match="ZieglerKLController.update needs n_samples"):
        ctrl.update(0.1)
    with pytest.raises(ValueError, match="n_samples must be a positive int .* got 0"):
        ctrl.update(0.1, 0)
    with pytest.raises(ValueError, match="current_kl must be finite, got nan"):
        ctrl.update(math.nan, 8)
    assert ctrl.value == 0.1  # a rejected update changes nothing
    with pytest.raises(ValueError, match="state is for a 'fixed' KL controller, this one is 'ziegler'"):
        ctrl.load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="state is for a 'pid' KL controller, this one is 'ziegler'"):
        ctrl.load_state_dict({"kind": "pid", "value": 0.3})
    with pytest.raises(ValueError, match="lacks target_kl, horizon"):
        ctrl.load_state_dict({"kind": "ziegler", "value": 0.3})


def test_band_by_name_is_the_documented_rule():
    ctrl = make_kl_controller("band", 1.0, 0.1)
    assert isinstance(ctrl, BandKLController) and ctrl.name == "band"
    # > 1.5 * target: x1.5; < 0.5 * target: x0.8; in between (bounds included): unchanged
    assert _run(ctrl, [0.16, 0.15, 0.05, 0.049, 0.1]) == pytest.approx([1.5, 1.5, 1.5, 1.2, 1.2], rel=1e-12)
    assert isinstance(make_kl_controller("ziegler", 0.1, 0.05), ZieglerKLController)
    import verl_ds.algos  # the old class names are gone (0.x): one name per controller
    assert not hasattr(verl_ds.algos, "AdaptiveKLController") and not hasattr(verl_ds.algos, "MultiplicativeKLController")


def test_state_saved_under_an_old_name_is_refused():
    ctrl = make_kl_controller("ziegler", 0.1, 0.05)
    # adaptive / multiplicative were renamed ziegler / band before 0.x aliases were dropped: no silent mapping
    with pytest.raises(ValueError, match="state is for a 'adaptive' KL controller, this one is 'ziegler'"):
        ctrl.load_state_dict({"kind": "adaptive", "value": 0.3, "target_kl": 0.05, "horizon": 500})
    assert ctrl.value == 0.1


def test_observed_kl_is_the_token_mean_not_the_mean_of_sequence_means():
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, float("nan"), 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    total, count = observed_kl(kl, mask)
    assert total.dtype == count.dtype == torch.float64 and total.shape == count.shape == ()
    assert (total.item(), count.item()) == (7.0, 5.0)
    # token mean 7 / 5 = 1.4; verl's mean of per-sequence means would be (1 + 3) / 2 = 2.0
    assert total.item() / count.item() == pytest.approx(1.4)
    # the token mean does not depend on how the batch is split over ranks: sum the (sum, count) pairs
    parts = [observed_kl(kl[i:i + 1], mask[i:i + 1]) for i in range(2)]
    assert sum(p[0].item() for p in parts) / sum(p[1].item() for p in parts) == pytest.approx(1.4)
    with pytest.raises(ValueError, match=r"shape mismatch: response_mask has shape \(2, 3\) but kl has shape"):
        observed_kl(kl, mask[:, :3])
