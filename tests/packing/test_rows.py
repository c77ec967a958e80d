"""verl_ds.rows: the one check of a batch and the one rule for prompt groups, positions and the response index, on
hand-computed cases and a plain loop over rows and columns."""
import random

import pytest
import torch

from verl_ds.rows import check_ids_and_mask, index_responses, position_ids_from_mask, prompt_groups

PAD = 0


def test_prompt_groups_by_hand():
    ids = torch.tensor([[PAD, 5, 6, 9],    # prompt (5 6), left-padded
                        [7, 5, 6, 8],      # (5 6) too: the pad's id differs, it still pads
                        [PAD, PAD, 6, 9],  # (6): another prompt
                        [PAD, 5, 6, 1],    # (5 6) again, not adjacent to the first two
                        [5, 6, PAD, 1],    # the same tokens in other places: another prompt
                        [PAD, PAD, 6, 2]])  # (6)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 1], [0, 0, 1, 1]]).bool()
    group, first = prompt_groups(ids, mask, 3)
    assert group.tolist() == [0, 0, 1, 0, 2, 1] and first.tolist() == [0, 2, 4]
    # all columns by default: the last column now tells every row apart
    group, first = prompt_groups(ids, mask)
    assert group.tolist() == [0, 1, 2, 3, 4, 5] and first.tolist() == [0, 1, 2, 3, 4, 5]
    # a pad never equals a real token, whatever the pad id
    ids2, mask2 = torch.tensor([[PAD, 4], [PAD, 4]]), torch.tensor([[0, 1], [1, 1]]).bool()
    assert prompt_groups(ids2, mask2)[0].tolist() == [0, 1]


def test_position_ids_from_mask_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 0, 1, 1]]).bool()
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3], [0, 0, 0, 1, 2]]


def _loop_index(ids, mask, R, place):
    """For every real token of the last R columns (row-major): its id, the place of the real token before it in its
    row, row * R + column."""
    B, T = ids.shape
    out = []
    for b in range(B):
        real = [t for t in range(T) if bool(mask[b, t])]
        for i, t in enumerate(real):
            if t >= T - R:
                out.append((int(ids[b, t]), int(place[b, real[i - 1]]), b * R + t - (T - R)))
    return out


def test_index_responses_by_hand():
    # two rows of prompt (P = 3) + response (R = 2); row 1's response has a gap, row 0's prompt is left-padded
    ids = torch.tensor([[PAD, 11, 12, 13, 14], [21, 22, 23, 24, PAD]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    place = torch.tensor([[99, 7, 8, 9, 10], [0, 1, 2, 3, 4]])  # row 0 packed after row 1
    idx = index_responses(ids, mask, 2, place)
    assert idx.label_ids.tolist() == [13, 14, 24] and idx.preds.tolist() == [8, 9, 2] and idx.out.tolist() == [0, 1, 2]
    assert idx.take is None


def test_index_responses_against_a_loop():
    rng = random.Random(0)
    for _ in range(100):
        B, T = rng.randint(1, 5), rng.randint(2, 8)
        R = rng.randint(1, T - 1)
        mask = torch.rand(B, T, generator=torch.Generator().manual_seed(rng.randint(0, 10**6))) < 0.7
        mask[:, 0] = True  # a real token before every response
        ids = torch.randint(1, 50, (B, T))
        place = torch.randperm(B * T).view(B, T)
        idx = index_responses(ids, mask, R, place)
        got = list(zip(idx.label_ids.tolist(), idx.preds.tolist(), idx.out.tolist()))
        assert got == _loop_index(ids, mask, R, place)


def test_index_responses_in_a_given_row_order():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    place = torch.arange(9).view(3, 3)
    idx = index_responses(ids, mask, 1, place, order=torch.tensor([2, 0, 1]))
    assert idx.label_ids.tolist() == [9, 3, 6] and idx.preds.tolist() == [7, 1, 4] and idx.out.tolist() == [2, 0, 1]


def test_check_batch_names_what_is_wrong():
    obs = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"who: mask must have the shape of observation, \(B, T\) = \(2, 5\), got "
                                         r"\(2, 5, 5\) \(pass the \(B, T\) attention mask, not a \(B, T, T\)"):
        check_ids_and_mask(obs, torch.ones(2, 5, 5, dtype=torch.bool), "who")
    with pytest.raises(ValueError, match=r"who: mask rows \[1\] have no real token"):
        check_ids_and_mask(obs, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]), "who")
    with pytest.raises(ValueError, match=r"who: mask must hold only 0/1, got values \[2\]"):
        check_ids_and_mask(obs, torch.full((2, 5), 2), "who")
    with pytest.raises(TypeError, match="who: mask must be bool \\(or 0/1 integers\\), got dtype torch.float32"):
        check_ids_and_mask(obs, torch.ones(2, 5), "who")  # float masks are refused
    with pytest.raises(TypeError, match=r"who: mask must be a \(B, T\) bool tensor, got list"):
        check_ids_and_mask(obs, [[1] * 5] * 2, "who")
    with pytest.raises(ValueError, match=r"who: mask is on meta but observation is on cpu"):
        check_ids_and_mask(obs, torch.ones(2, 5, dtype=torch.bool, device="meta"), "who")
    with pytest.raises(TypeError, match=r"who: observation must be a \(B, T\) int64 tensor of token ids, got list"):
        check_ids_and_mask([[1, 2]], None, "who")
    with pytest.raises(ValueError, match=r"who: observation must be 2-D \(B, T\), got shape \(3,\)"):
        check_ids_and_mask(torch.ones(3, dtype=torch.long), None, "who")
    with pytest.raises(ValueError, match=r"who: observation is empty: shape \(2, 0\)"):
        check_ids_and_mask(torch.ones(2, 0, dtype=torch.long), None, "who")
    with pytest.raises(TypeError, match="who: input_ids must hold int64 token ids, got dtype torch.float32"):
        check_ids_and_mask(torch.ones(2, 2), None, "who", ("input_ids", "attention_mask"))
    ids, mask = check_ids_and_mask(torch.ones(2, 5, dtype=torch.int32), torch.ones(2, 5, dtype=torch.long), "who")
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool
    assert check_ids_and_mask(obs, None, "who")[1].tolist() == [[True] * 5] * 2
