"""algo.kl_kind=full_symmetric at the model level (verl_ds.models.full_kl): the exact full-vocabulary symmetric KL
of actor vs reference at each response position, and its gradient into the actor, in every row layout (padded, fused
head, packed, shared prompts and response prefixes), against a float64 reference from both models' full logits with
each sequence run alone."""
import copy

import pytest
import torch

from packing_testutil import VOCAB, tiny_lm
from verl_ds.models import PolicyModel, ReferenceModel
from verl_ds.models.full_kl import logprobs_with_full_kl
from verl_ds.models.varlen_attention import use_varlen_attention

T_SAMPLE = 0.7
P, R = 5, 4


def _batch():
    """Rows 0-1 and 2-3 share a prompt (and rows 0-1 their first response token); row 3 has a 1-token response."""
    g = torch.Generator().manual_seed(3)
    prompts = [[0, 0, 5, 9, 11], [0, 0, 5, 9, 11], [7, 8, 3, 4, 6], [7, 8, 3, 4, 6]]
    resp = torch.randint(3, VOCAB, (4, R), generator=g)
    resp[1, 0] = resp[0, 0]
    obs = torch.cat([torch.tensor(prompts), resp], 1)
    mask = obs != 0
    mask[3, P + 1:] = False
    mask[1, P + 3:] = False
    return torch.where(mask, obs, 0), mask


def _reference(actor_lm, ref_lm, obs, mask):
    """float64 J (B, R) from each row run alone through both models: full logits, log_softmax, the definition."""
    B, T = obs.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        cols = mask[b].nonzero().flatten()
        ids = obs[b, cols].unsqueeze(0)
        resp = (cols >= T - R).nonzero().flatten()
        x = actor_lm(input_ids=ids, use_cache=False).logits[0, resp - 1].double() / T_SAMPLE
        with torch.no_grad():
            y = ref_lm(input_ids=ids, use_cache=False).logits[0, resp - 1].double() / T_SAMPLE
        lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
        out[b, cols[resp] - (T - R)] = 0.5 * ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)
    return out


LAYOUTS = {"padded": {}, "padded_fused": {"fused_lm_head": True}, "packed": {"remove_padding": True},
           "shared_prefixes": {"remove_padding": True, "share_prompts": True, "share_prefixes": True}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_full_kl_matches_float64_full_logits_value_and_gradient(layout):
    actor_lm = tiny_lm("llama", seed=1)
    ref_lm = copy.deepcopy(actor_lm)
    with torch.no_grad():
        for p in ref_lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kw = LAYOUTS[layout]
    if kw.get("share_prompts"):
        use_varlen_attention(actor_lm), use_varlen_attention(ref_lm)
    obs, mask = _batch()
    rmask = mask[:, -R:]
    w = torch.rand(obs.shape[0], R) + 0.5
    want = _reference(actor_lm, ref_lm, obs, mask)
    actor_lm.zero_grad()
    (want * w * rmask).sum().backward()
    want_g = {n: p.grad.clone() for n, p in actor_lm.named_parameters()}
    actor_lm.zero_grad()
    actor, ref = PolicyModel(actor_lm, **kw), ReferenceModel(ref_lm, **kw)
    lp, ent, kl = logprobs_with_full_kl(actor, ref, obs, obs[:, -R:], mask, T_SAMPLE)
    assert kl.shape == (4, R) and kl.dtype == torch.float32
    plain_lp, plain_ent = actor.get_logprob(obs, obs[:, -R:], mask, T_SAMPLE, return_entropy=True)
    torch.testing.assert_close(lp * rmask, plain_lp.detach() * rmask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent * rmask, plain_ent.detach() * rmask, atol=1e-5, rtol=1e-5)
    assert want[rmask].min() > 1e-4  # the models differ: a real KL to match
    torch.testing.assert_close(kl.double() * rmask, want * rmask, atol=1e-6, rtol=1e-4)
    actor_lm.zero_grad()
    (kl * w * rmask).sum().backward()
    assert all(p.grad is None for p in ref_lm.parameters())
    for n, p in actor_lm.named_parameters():
        torch.testing.assert_close(p.grad.double(), want_g[n].double(), atol=1e-6, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_full_kl_of_a_model_against_itself_is_zero():
    lm = tiny_lm("llama", seed=2)
    obs, mask = _batch()
    model = PolicyModel(lm, remove_padding=True)
    _, _, kl = logprobs_with_full_kl(model, ReferenceModel(lm, remove_padding=True), obs, obs[:, -R:], mask, 1.0)
    assert kl[mask[:, -R:]].abs().max().item() < 1e-6


def test_layouts_that_differ_are_refused():
    lm = tiny_lm("llama", seed=2)
    obs, mask = _batch()
    with pytest.raises(ValueError, match="pack micro-batches alike"):
        logprobs_with_full_kl(PolicyModel(lm, remove_padding=True), ReferenceModel(lm), obs, obs[:, -R:], mask, 1.0)


def test_padded_fused_head_scores_a_batch_like_the_logits_path():
    """model.remove_padding=false with model.fused_lm_head=true and B > 1 (the fused head once returned (1, B*k, 2))."""
    lm = tiny_lm("llama", seed=4)
    obs, mask = _batch()
    rmask = mask[:, -R:]
    want = PolicyModel(lm).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE, return_entropy=True)
    got = PolicyModel(lm, fused_lm_head=True).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE, return_entropy=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g * rmask, w * rmask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_no_model_builds_more_than_a_chunk_of_logits(monkeypatch, layout):
    """A spy on the heads' outputs and on the KL's logit chunks: neither model's LM head returns (n, V) logits, and
    each chunk holds at most chunk_rows tokens' logits per model, forward and backward."""
    import verl_ds.algos.full_kl as full_kl

    chunk_rows = 3
    monkeypatch.setattr(full_kl, "_HEAD_CPU_ELEMS", chunk_rows * VOCAB)
    seen, real = [], full_kl.full_symmetric_kl

    def spy(x, y, t):
        seen.append((tuple(x.shape), tuple(y.shape)))
        return real(x, y, t)

    monkeypatch.setattr(full_kl, "full_symmetric_kl", spy)
    actor_lm, ref_lm = tiny_lm("llama", seed=1), tiny_lm("llama", seed=2)
    widths = []
    for lm in (actor_lm, ref_lm):
        lm.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[-1]))
    obs, mask = _batch()
    kw = LAYOUTS[layout]
    _, _, kl = logprobs_with_full_kl(PolicyModel(actor_lm, **kw), ReferenceModel(ref_lm, **kw), obs, obs[:, -R:],
                                     mask, 1.0)
    kl.sum().backward()
    assert widths and max(widths) <= 3  # [log-prob, entropy, kl] per row, never V logits
    n_fwd = -(-int(mask[:, -R:].sum() if layout == "packed" else obs.shape[0] * (R + 1)) // chunk_rows)
    assert len(seen) == 2 * n_fwd  # forward and backward went chunk by chunk
    assert all(x[0] <= chunk_rows and x == y and x[1] == VOCAB for x, y in seen), seen
