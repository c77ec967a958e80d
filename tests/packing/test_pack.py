"""verl_ds.packing.pack / unpack against a plain loop over rows and columns; transformers reads the packed
position ids as separate sequences; bad input is named."""
import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from verl_ds.rows import position_ids_from_mask
from verl_ds.packing import pack, unpack


def _loop_pack(ids, mask):
    out_ids, out_pos, flat, cu = [], [], [], [0]
    B, T = ids.shape
    for b in range(B):
        k = 0
        for t in range(T):
            if bool(mask[b, t]):
                out_ids.append(int(ids[b, t]))
                out_pos.append(k)
                flat.append(b * T + t)
                k += 1
        cu.append(cu[-1] + k)
    return out_ids, out_pos, flat, cu


def _batch():
    ids = torch.arange(1, 31).view(5, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1],   # left padded
                         [1, 1, 1, 0, 0, 0],   # right padded
                         [0, 1, 1, 1, 0, 0],   # both (a left-padded prompt, a right-padded response)
                         [1, 1, 1, 1, 1, 1],   # no padding
                         [0, 0, 0, 0, 0, 1]],  # one token
                        dtype=torch.bool)
    return ids, mask


def test_pack_matches_the_loop_and_the_padded_position_ids():
    ids, mask = _batch()
    p = pack(ids, mask)
    want_ids, want_pos, want_flat, want_cu = _loop_pack(ids, mask)
    assert p.input_ids.tolist() == [want_ids] and p.position_ids.tolist() == [want_pos]
    assert p.indices.tolist() == want_flat and p.cu_seqlens.tolist() == want_cu
    assert p.cu_seqlens.dtype == torch.int32 and p.input_ids.dtype == torch.int64
    assert p.lengths.tolist() == [4, 3, 3, 6, 1] and p.max_seqlen == 6 and p.shape == (5, 6)
    assert p.num_tokens == 17
    # the padded path's position ids at the real tokens
    assert position_ids_from_mask(mask).reshape(-1)[p.indices].tolist() == want_pos
    assert p.attention_kwargs() == {"cu_seq_lens_q": p.cu_seqlens, "cu_seq_lens_k": p.cu_seqlens,
                                    "max_length_q": 6, "max_length_k": 6, "verl_ds_attention_layout": p.layout}


def _loop_scoring_pack(ids, mask, R):
    """The rows without each one's last real token when it is a response token, and for every real response
    token (row-major): its id, the packed index of the previous real token of its row, row * R + column."""
    B, T = ids.shape
    kept, where, targets = [], {}, []
    for b in range(B):
        real = [t for t in range(T) if bool(mask[b, t])]
        for t in real[:-1] if real[-1] >= T - R else real:
            where[(b, t)] = len(kept)
            kept.append(int(ids[b, t]))
        for i, t in enumerate(real):
            if t >= T - R:
                targets.append((int(ids[b, t]), where[(b, real[i - 1])], b * R + t - (T - R)))
    return kept, targets


@pytest.mark.parametrize("R", [1, 2, 3])
def test_scoring_pack_leaves_out_each_last_response_token(R):
    ids, mask = _batch()
    mask[4, 1] = True  # a prompt for the one-token row
    p = pack(ids, mask, R)
    kept, targets = _loop_scoring_pack(ids, mask, R)
    assert p.input_ids[0].tolist() == kept and p.num_tokens == len(kept) < int(mask.sum())
    got = list(zip(p.targets.label_ids.tolist(), p.targets.preds.tolist(), p.targets.out.tolist()))
    assert got == targets and p.response_width == R
    # positions and sequence bounds are those of the rows without their last token
    assert p.position_ids[0].tolist() == [i for n in p.lengths.tolist() for i in range(n)]
    assert p.cu_seqlens.tolist() == [0] + torch.cumsum(p.lengths, 0).tolist()
    with pytest.raises(ValueError, match=r"response_width \(R\) must be an int with 1 <= R < T=6, got 6"):
        pack(ids, mask, 6)
    mask[4, 1] = False
    with pytest.raises(ValueError, match=r"rows \[4\] have no real token before their response"):
        pack(ids, mask, 1)


def test_transformers_reads_one_sequence_per_row():
    ids, mask = _batch()
    p = pack(ids, mask)
    seq = find_packed_sequence_indices(p.position_ids)
    assert seq.tolist() == [[0] * 4 + [1] * 3 + [2] * 3 + [3] * 6 + [4]]


def test_unpack_restores_the_padded_layout_with_fill_and_gradients():
    ids, mask = _batch()
    p = pack(ids, mask.long())  # 0/1 integer masks are accepted
    back = unpack(p, p.input_ids.float())
    assert torch.equal(back, torch.where(mask, ids, 0).float())
    vals = torch.randn(p.num_tokens, 3, requires_grad=True)
    out = unpack(p, vals, fill=-1.0)
    assert out.shape == (5, 6, 3) and bool((out[~mask] == -1).all())
    assert torch.equal(out[mask], vals.detach())
    out.sum().backward()
    assert torch.equal(vals.grad, torch.ones(p.num_tokens, 3))


def test_bad_input_is_named():
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"pack: attention_mask must have the shape of input_ids, .* = \(5, 6\), got \(5, 5\)"):
        pack(ids, mask[:, :5])
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        pack(ids, torch.tensor([[1] * 6, [0] * 6, [1] * 6, [1] * 6, [1] * 6]))
    with pytest.raises(ValueError, match="only 0/1, got values \\[2\\]"):
        pack(ids, mask.long() * 2)
    with pytest.raises(TypeError, match="must be bool"):
        pack(ids, mask.float())
    with pytest.raises(TypeError, match="int64 token ids"):
        pack(ids.float(), mask)
    with pytest.raises(ValueError, match="2-D"):
        pack(ids[0], mask[0])
    p = pack(ids, mask)
    with pytest.raises(ValueError, match=r"N = 17 packed tokens, got \(16,\)"):
        unpack(p, torch.zeros(16))


def test_scoring_with_another_width_than_packed_is_refused():
    from verl_ds.models.packed_forward import response_index

    ids, mask = _batch()
    mask[4, 1] = True
    with pytest.raises(ValueError, match=r"response_width R=1 differs from the width the batch was packed with \(2\)"):
        response_index(pack(ids, mask, 2), 1)
