"""Token budgets with shared prompts (``micro_batch_groups(..., share_prompts=True)``): the samples of a prompt stay
in one micro-batch and its prompt is counted once, as ``verl_ds.prompt_sharing`` packs it; a group over the budget
is cut into consecutive pieces that fit. Checked against a plain count over rows and by hand."""
import random

import torch

import verl_ds.packing as packing
from verl_ds.batch import RolloutBatch
from verl_ds.packing import micro_batch_groups
from verl_ds.rows import prompt_groups
from verl_ds.prompt_sharing import pack_shared_prompts

PAD, EOS = 0, 1


def _batch(prompts, n, response_lengths, R):
    """n consecutive samples per prompt (token lists), left-padded; responses of the given lengths."""
    P = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], dtype=torch.bool)
    resp = torch.tensor([[5 + j for j in range(R)] for _ in rows])
    return RolloutBatch.from_generation(ids, mask, resp, torch.tensor(response_lengths), pad_token_id=PAD)


def _cost(batch, rows):
    """Tokens of the shared packed row, counted plainly: each distinct run's prompt once, every response token."""
    total, seen = 0, None
    for r in rows:
        prompt = tuple(batch.observation[r, :batch.prompt_width][batch.mask[r, :batch.prompt_width]].tolist())
        if prompt != seen or r - 1 not in rows:
            total += len(prompt)
        seen = prompt
        total += int(batch.response_length[r])
    return total


def test_hand_case_counts_each_prompt_once():
    # prompts of 4, 2 and 3 tokens, 2 samples each, responses 3+3, 2+1, 4+4: shared costs 10, 5, 11
    b = _batch([[7, 8, 9, 10], [11, 12], [13, 14, 15]], 2, [3, 3, 2, 1, 4, 4], R=4)
    assert prompt_groups(b.observation, b.mask, b.prompt_width)[0].tolist() == [0, 0, 1, 1, 2, 2]
    assert micro_batch_groups(b, 2, 16, share_prompts=True) == [[0, 1, 2, 3], [4, 5]]  # 10 + 5 fit, 11 alone
    # row by row the same budget needs three micro-batches (7 7 4 3 7 7) and splits prompts' samples
    assert len(micro_batch_groups(b, 2, 16)) == 3
    # a group over the budget is cut into pieces that fit, each paying its prompt
    assert micro_batch_groups(b, 2, 8, share_prompts=True) == [[0], [1], [2, 3], [4], [5]]


def test_equal_prompts_apart_in_the_batch_count_once():
    """Rows 0, 1 and 4, 5 share prompt a (``verl_ds.rows.prompt_groups``, the rule the shared packing follows): one
    micro-batch pays it once, 4 + 3 * 4 = 16 tokens; counted as two runs (10 + 10 + 5 with prompt b) they would
    take the budget as 15 and 10."""
    b = _batch([[7, 8, 9, 10], [11, 12], [7, 8, 9, 10]], 2, [3, 3, 2, 1, 3, 3], R=4)
    assert prompt_groups(b.observation, b.mask, b.prompt_width)[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert micro_batch_groups(b, 2, 16, share_prompts=True) == [[0, 1, 4, 5], [2, 3]]
    sub = b.select([0, 1, 4, 5])
    assert pack_shared_prompts(sub.observation, sub.mask, 4).input_ids.shape[1] == 16 - 4  # last tokens unfed


def test_random_batches_keep_groups_and_the_budget():
    rng = random.Random(0)
    for case in range(200):
        n, R = rng.choice([1, 2, 4, 8]), rng.randint(1, 6)
        prompts = [[rng.randint(2, 60) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 6))]
        b = _batch(prompts, n, [rng.randint(1, R) for _ in range(len(prompts) * n)], R)
        budget = rng.randint(6, 60)
        parts = micro_batch_groups(b, 1, budget, share_prompts=True)
        assert sorted(r for p in parts for r in p) == list(range(len(b)))
        for p in parts:
            assert p == sorted(p)
            one_row_over = len(p) == 1 and _cost(b, p) > budget
            assert _cost(b, p) <= budget or one_row_over, (case, p, _cost(b, p), budget)
        where = {r: i for i, p in enumerate(parts) for r in p}
        for g in range(len(prompts)):  # a group that fits is never split
            rows = list(range(g * n, (g + 1) * n))
            if _cost(b, rows) <= budget:
                assert len({where[r] for r in rows}) == 1, (case, rows, parts)
        # the packed rows the model would build are no longer than the count (the last token is left out)
        for p in parts:
            sub = b.select(p)
            assert pack_shared_prompts(sub.observation, sub.mask, R).input_ids.shape[1] <= _cost(b, p)


def test_more_micro_batches_agreed_elsewhere_cut_the_largest_group(monkeypatch):
    b = _batch([[7, 8, 9], [11, 12]], 4, [2] * 8, R=2)  # two groups of cost 11 and 10
    assert micro_batch_groups(b, 1, 64, share_prompts=True) == [list(range(8))]
    monkeypatch.setattr(packing, "agree_num_micro_batches", lambda local: 3)  # another rank needs 3
    parts = micro_batch_groups(b, 1, 64, share_prompts=True)
    assert len(parts) == 3 and sorted(r for p in parts for r in p) == list(range(8))
    assert all(p == list(range(p[0], p[-1] + 1)) for p in parts)  # consecutive rows: their prompt stays shared
