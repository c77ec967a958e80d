"""verl_ds/algos/response_logprob.py: response log-probs from (B, R+1, V) logits without a copy of the logits.

Equal (forward and backward) to the path the policy uses today, ``logprobs_and_entropy(logits[:, :-1], labels)``,
and to a float64 reference; an allocation recorder (a TorchDispatchMode that sees every op's new output
storage) shows the forward allocates nothing of the logits' size and the backward only the logits' gradient,
while today's path copies the sliced logits in the forward."""
import pytest
import torch
from kernel_refs import DEVICE, GRAD_TOL, TOL, assert_close, ref_logprob_entropy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from verl_ds.algos import logprobs_and_entropy
from verl_ds.algos.response_logprob import response_logprobs


def _storage_id(x):
    if isinstance(x, torch.Tensor):
        return x.untyped_storage()._cdata
    if isinstance(x, torch.UntypedStorage):
        return x._cdata
    if isinstance(x, torch.TypedStorage):
        return x._untyped_storage._cdata
    return None


class NewStorages(TorchDispatchMode):
    """Bytes of every storage an op returns that none of its inputs had (an allocation; Triton's interpreter
    re-wraps its arguments' storages with ``set_``, which is not one)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_storage_id(x) for x in tree_leaves((args, kwargs or {}))}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("VERL_DS_KERNELS", "triton")  # the kernels in Triton's interpreter (conftest)


def _inputs(B=3, R=5, V=1003, dtype=torch.float32):
    logits = (torch.randn(B, R + 1, V, device=DEVICE) * 3).to(dtype)
    labels = torch.randint(0, V, (B, R), device=DEVICE)
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [True, False])
def test_equals_todays_path_and_the_float64_reference(dtype, entropy):
    logits, labels = _inputs(dtype=dtype)
    w_lp, w_ent = torch.randn(labels.shape, device=DEVICE), torch.randn(labels.shape, device=DEVICE)
    x = logits.clone().requires_grad_()
    lp, ent = response_logprobs(x, labels, temperature=0.8, compute_entropy=entropy)
    ((w_lp * lp).sum() + ((w_ent * ent).sum() if entropy else 0)).backward()
    y = logits.clone().requires_grad_()
    lp_old, ent_old = logprobs_and_entropy(y[:, :-1], labels, 0.8)
    ((w_lp * lp_old).sum() + ((w_ent * ent_old).sum() if entropy else 0)).backward()
    assert lp.shape == labels.shape and lp.dtype == torch.float32
    assert torch.equal(lp, lp_old)  # the same kernel on the same rows: bitwise
    assert (ent is None) != entropy and (not entropy or torch.equal(ent, ent_old))
    assert_close(x.grad, y.grad, **GRAD_TOL[dtype], what="grad vs today's path")
    assert (x.grad[:, -1] == 0).all()  # the last position predicts nothing
    z = logits.detach().double()[:, :-1].reshape(-1, logits.shape[-1]).requires_grad_()
    lp_ref, ent_ref = ref_logprob_entropy(z, labels.reshape(-1), 0.8)
    assert_close(lp, lp_ref.view(labels.shape), **TOL[dtype], what="logprob vs float64")
    if entropy:
        assert_close(ent, ent_ref.view(labels.shape), **TOL[dtype], what="entropy vs float64")


def test_no_logits_sized_allocation():
    logits, labels = _inputs(B=2, R=6, V=4001)
    logits_bytes = logits.numel() * logits.element_size()
    x = logits.clone().requires_grad_()
    with NewStorages() as fwd:
        lp, ent = response_logprobs(x, labels, compute_entropy=True)
    loss = lp.sum() + ent.sum()
    with NewStorages() as bwd:
        loss.backward()
    assert max(fwd.sizes) < logits_bytes // 100, sorted(fwd.sizes)[-3:]
    big = [s for s in bwd.sizes if s >= logits_bytes // 100]
    assert big == [logits_bytes], big  # the logits' gradient, once
    y = logits.clone().requires_grad_()
    with NewStorages() as old:  # today's path: the sliced logits are copied for the kernel
        logprobs_and_entropy(y[:, :-1], labels)
    assert max(old.sizes) >= logits_bytes * 6 // 7


def test_a_slice_along_positions_is_read_in_place_too():
    logits, labels = _inputs(B=2, R=4, V=997)
    longer = torch.cat([torch.randn(2, 3, 997, device=DEVICE), logits], dim=1).requires_grad_()
    with NewStorages() as fwd:
        lp, _ = response_logprobs(longer[:, -5:], labels)
    assert max(fwd.sizes) < longer.numel() * 4 // 100
    expected, _ = response_logprobs(logits.clone(), labels)
    assert torch.equal(lp, expected)
    lp.sum().backward()
    assert (longer.grad[:, :3] == 0).all() and (longer.grad[:, -1] == 0).all()


@pytest.mark.parametrize("logits,labels,match", [
    (torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.long), r"logits must be \(B, R\+1, V\)"),
    (torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long), r"labels must have shape \(B, R\) = \(2, 4\)"),
    (torch.zeros(2, 5, 7), torch.zeros(2, 4), "labels must be an integer"),
    (torch.zeros(2, 5, 7), torch.full((2, 4), 7), r"labels must be token ids in \[0, V\) = \[0, 7\), got 7"),
    (torch.zeros(2, 5, 7), torch.full((2, 4), -100), r"got -100"),
])
def test_bad_input_says_what_is_wrong(logits, labels, match):
    with pytest.raises((ValueError, TypeError), match=match):
        response_logprobs(logits.to(DEVICE), labels.to(DEVICE))
